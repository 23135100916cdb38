"""`overdrive plan` counts an epoch as the run counts it, for every objective: RL's completion slots
(prompts x generations), preference pairs, KTO's rows, labelled rows; and speaks of a validation
hold-out only where the run holds one out (no training here: the token cache is filled in-process)."""

from __future__ import annotations

import json
import random

import pytest

from hf_fixtures import make_preference_data, make_tiny_llama
from overdrive.cli import main
from overdrive.resolving import resolve


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("plan") / "llama")


def _plan(capsys, *items) -> dict:
    assert main(["plan", *items, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _text(capsys, *items) -> str:
    assert main(["plan", *items]) == 0
    return capsys.readouterr().out


def test_an_rl_epoch_is_every_prompts_group_of_completions_and_has_no_hold_out(llama, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "ok") * 8))
    items = [f"model.name_or_path={llama}", f"data.source={prompts}", "data.format=prompts", "data.max_length=64",
             "rl.method=grpo", "rl.num_generations=4", "rl.num_iterations=2",
             "rl.reward_funcs=[{function: exact_match, column: answer}]", "training.micro_batch_size=4",
             "training.num_epochs=3", f"output_dir={tmp_path / 'out'}"]
    data = _plan(capsys, *items)
    # 16 prompts x 4 generations x 2 iterations = 128 completion slots (data/prompts.Slots), 4 a step
    assert (data["samples_per_epoch"], data["steps_per_epoch"], data["max_steps"]) == (128, 32, 96)
    assert data["validation_held_out"] == 0
    steps = next(line for line in _text(capsys, *items).splitlines() if line.startswith("steps"))
    assert "hold-out" not in steps and "16 prompts" in steps, steps


def _rows(path, count: int) -> None:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice("abcde") for _ in range(8)),
                                        "label": rng.choice(["x", "y"])}) + "\n" for _ in range(count)))


@pytest.mark.parametrize("objective", ["dpo", "kto", "classification"])
def test_a_row_objectives_epoch_is_its_pairs_or_rows_less_the_hold_out_exact_once_cached(llama, tmp_path, capsys,
                                                                                         objective):
    from overdrive.data import prepare
    from overdrive.training.build.tokenizer import build_tokenizer

    data_file = tmp_path / "data.jsonl"
    if objective == "classification":
        _rows(data_file, 300)
        items = ["model.task=sequence-classification", "data.label_column=label"]
    else:
        make_preference_data(data_file, rows=200)
        items = ["data.format=preference", f"preference.method={objective}"]
    items = [f"model.name_or_path={llama}", f"data.source={data_file}", "data.max_length=128",
             "training.micro_batch_size=4", "training.num_epochs=2", f"data.cache_dir={tmp_path / 'cache'}",
             f"output_dir={tmp_path / 'out'}", *items]
    estimated = _plan(capsys, *items)
    cfg = resolve((), cli=items, env={}).config
    _, tokens = prepare(cfg, build_tokenizer)  # the token cache the run fills, and its train set
    samples = len(tokens.train)  # what training/build/parts.py counts an epoch in
    assert abs(estimated["samples_per_epoch"] - samples) <= 0.05 * samples, (estimated["samples_per_epoch"], samples)
    exact = _plan(capsys, *items)
    assert exact["samples_per_epoch"] == samples and exact["steps_per_epoch"] == samples // 4
    assert exact["max_steps"] == 2 * (samples // 4) and exact["validation_held_out"] == pytest.approx(0.02)
