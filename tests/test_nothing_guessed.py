"""Nothing guessed: an imported tool config whose data set cannot be found, whose keys belong to
two tools, or whose value has the wrong type is refused by the imported file's key with its
file:line, never read with a fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overdrive.errors import UserError
from overdrive.resolving import resolve


def refusal(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(UserError) as error:
        resolve([path], env={}, accelerate_default=False)
    return [(p.key, p.where) for p in error.value.problems]


def test_a_llamafactory_data_set_that_cannot_be_found_is_refused_not_left_to_the_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "sft.yaml"
    run.write_text("model_name_or_path: m\nstage: sft\nfinetuning_type: lora\ndataset: my_data\n")
    assert refusal(run) == [("dataset", f"{run}:4")]  # no dataset_info.json at all
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"my_data": {"file_name": "mine.json"}}))
    assert refusal(run) == [("dataset", f"{run}:4")]  # named, but its file is not there
    (tmp_path / "data" / "mine.json").write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))
    config = resolve([run], env={}, accelerate_default=False).config
    assert Path(config.data.source) == tmp_path / "data" / "mine.json"
    run.write_text("model_name_or_path: m\nstage: sft\nfinetuning_type: lora\ndataset: other\n")
    assert refusal(run) == [("dataset", f"{run}:4")]  # not in dataset_info.json


def test_a_file_with_two_tools_keys_is_refused_by_the_other_tools_key(tmp_path):
    both = tmp_path / "both.yml"
    both.write_text("base_model: m\nadapter: lora\nlora_r: 8\nfinetuning_type: lora\nlora_rank: 8\n")
    assert refusal(both) == [("finetuning_type", f"{both}:4")]


def test_an_axolotl_value_of_the_wrong_type_is_refused_by_its_key(tmp_path):
    bad = tmp_path / "lora.yml"
    bad.write_text("base_model: m\nadapter: lora\nlora_r: sixteen\n")
    assert refusal(bad) == [("lora_r", f"{bad}:3")]


@pytest.mark.parametrize("argv, expected", [
    (["train", "--epochs", "2"], "training.num_epochs=2"),
    (["train", "--num_train_epochs=3"], "training.num_epochs=3"),
    (["train", "--warmup", "10"], "scheduler.warmup_steps=10"),
    (["train", "--per-device-train-batch-size", "4"], "training.micro_batch_size=4"),
    (["train", "--grad-accum", "8"], "training.gradient_accumulation_steps=8"),
    (["plan", "--max-seq-length", "512"], "data.max_length=512"),
    (["train", "--bf16"], "precision.mixed_precision=bf16"),
    (["train", "--lora-r", "16"], "peft.r=16"),
    (["train", "--beta", "0.1"], "preference.beta=0.1"),
    (["train", "--steps", "5"], "training.max_steps=5"),
])
def test_the_flags_other_tools_taught_get_the_key_value_hint(capsys, argv, expected):
    from overdrive.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "usage:" not in err, err


def test_a_missing_local_data_file_is_refused_by_key_before_the_libraries_load(tmp_path):
    from overdrive.hub import refuse_missing_data
    from overdrive.resolving import load_config

    for source in ("missing.jsonl", str(tmp_path / "nope" / "rows.csv")):
        cfg = load_config(cli=[f"data.source={source}"], env={})  # explain, plan and export still read it
        with pytest.raises(UserError) as error:
            refuse_missing_data(cfg)
        assert [p.key for p in error.value.problems] == ["data.source"]
        assert "does not exist" in error.value.render() and "hf download" not in error.value.render()
    refuse_missing_data(load_config(cli=["data.source=https://example.org/rows.jsonl"], env={}))


@pytest.mark.parametrize("value", ["true", "16.5", "[8]", "sixteen"])
def test_an_axolotl_lora_r_that_is_no_whole_number_is_refused_by_its_key(tmp_path, value):
    bad = tmp_path / "lora.yml"
    bad.write_text(f"base_model: m\nadapter: lora\nlora_r: {value}\n")
    assert refusal(bad) == [("lora_r", f"{bad}:3")]
