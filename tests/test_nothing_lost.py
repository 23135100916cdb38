"""Nothing lost, nothing guessed: no command writes over or into what it reads; an adapter
merged into a base it does not fit is refused by key, naming both; a relative base stored in
adapter_config.json is read from the adapter's directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, run_here
from hf_fixtures import make_tiny_llama, tree_hash

from overdrive.errors import UserError
from overdrive.storage.overlap import refuse_overlap, relation



@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A LoRA adapter of a tiny Llama (hidden 32), saved by PEFT with a relative base path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("merge")
    make_tiny_llama(root / "base")
    make_tiny_llama(root / "wide", hidden_size=64)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base"),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(root / "adapter")
    config = root / "adapter" / "adapter_config.json"
    saved = json.loads(config.read_text())
    saved["base_model_name_or_path"] = "../base"  # relative to the adapter's own directory
    config.write_text(json.dumps(saved))
    return root / "adapter"


def test_the_relation_of_an_output_to_an_input(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert relation(tmp_path / "a", tmp_path / "a" / "." ) == "is"
    assert relation(tmp_path, tmp_path / "a" / "b") == "contains"
    assert relation(tmp_path / "a" / "b" / "c", tmp_path / "a") == "lies inside"
    assert relation(tmp_path / "a" / "x", tmp_path / "a" / "b") is None
    with pytest.raises(UserError) as error:
        refuse_overlap({"--output": tmp_path / "a" / ".." / "a"}, {"ADAPTER": tmp_path / "a"})
    assert error.value.problems[0].key == "--output"


@pytest.mark.slow
def test_merge_into_its_own_adapter_is_refused_even_with_force(adapter):
    before = tree_hash(adapter)
    for extra in ([], ["--force"]):
        for output in (adapter, adapter / "merged", adapter.parent):
            result = run_cli("merge", str(adapter), "-o", str(output), *extra)
            assert result.returncode == 2, result.stderr[-2000:]
            assert "--output" in result.stderr and "ADAPTER" in result.stderr and "Traceback" not in result.stderr
    assert tree_hash(adapter) == before


@pytest.mark.slow
def test_merge_reads_a_relative_base_from_the_adapters_directory(adapter, tmp_path):
    result = run_cli("merge", str(adapter), "-o", str(tmp_path / "merged"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "merged" / "config.json").is_file()
    assert str(adapter.parent / "base") in result.stderr
    # Library noise naming nothing the user can change is not passed on.
    assert "kernels-community" not in result.stderr and "FutureWarning" not in result.stderr


@pytest.mark.slow
def test_merge_into_a_base_it_does_not_fit_names_both(adapter, tmp_path):
    wide = adapter.parent / "wide"
    result = run_cli("merge", str(adapter), "-o", str(tmp_path / "merged"), "--base", str(wide))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--base" in result.stderr and str(adapter) in result.stderr and str(wide) in result.stderr
    assert "q_proj" in result.stderr and "state_dict" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "merged").exists()


def test_import_export_docs_and_report_never_write_over_their_input(tmp_path):
    source = tmp_path / "acc.yaml"
    source.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: bf16\n")
    kept = source.read_bytes()
    imported = run_here("import", str(source), "-o", str(source), "--force")
    assert imported.returncode == 2 and "--output" in imported.stderr, imported.stderr
    assert source.read_bytes() == kept
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("optim:\n  lr: 0.001\n")
    exported = run_here("export", str(run_yaml), "--accelerate", str(run_yaml), "--force")
    assert exported.returncode == 2 and "--accelerate" in exported.stderr, exported.stderr
    assert run_yaml.read_text() == "optim:\n  lr: 0.001\n"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "time": 1.0}) + "\n")
    report = run_here("report", str(run_dir), "-o", str(run_dir), "--force")
    assert report.returncode == 2 and "-o/--out" in report.stderr, report.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    import overdrive.config.schema as schema

    code = Path(schema.__file__)
    text = code.read_bytes()
    docs = run_here("docs", "-o", str(code), "--force")
    assert docs.returncode == 2 and "-o/--output" in docs.stderr, docs.stderr
    assert code.read_bytes() == text


def test_a_run_never_writes_over_the_model_or_data_it_reads(tmp_path):
    from overdrive.resolving import resolve

    (tmp_path / "prev" / "model").mkdir(parents=True)
    (tmp_path / "prev" / "model" / "config.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("hello\n")
    cases = [[f"model.name_or_path={tmp_path / 'prev' / 'model'}", f"output_dir={tmp_path / 'prev'}"],
             [f"data.source={data}", f"output_dir={data / 'run'}"],
             [f"data.source={data}", f"output_dir={data}"],
             # every local input: the teacher, the tokenizer, a mixture's source, the eval prompts
             [f"distill.teacher={tmp_path / 'prev' / 'model'}", f"output_dir={tmp_path / 'prev' / 'model'}"],
             [f"tokenizer.name_or_path={tmp_path / 'prev' / 'model'}", f"output_dir={tmp_path / 'prev'}"],
             [f"data.sources=[{{name: a, source: {data}}}]", f"output_dir={data / 'run'}"],
             [f"eval.prompts={tmp_path / 'prev' / 'model' / 'config.json'}", f"output_dir={tmp_path / 'prev'}"]]
    for items in cases:
        with pytest.raises(UserError) as error:
            resolve([], cli=items, env={}, accelerate_default=False)
        assert [p.key for p in error.value.problems] == ["output_dir"], error.value.render()
    resolve([], cli=[f"data.source={data}", f"output_dir={tmp_path / 'run'}"], env={}, accelerate_default=False)


@pytest.mark.slow
def test_a_finished_run_rerun_unchanged_says_it_is_complete_and_where_its_model_is(tmp_path):
    from checkpoint_probe import command, run

    out, cache = tmp_path / "run", tmp_path / "cache"
    args = ["training.max_steps=2", "checkpoint.every_steps=2", "checkpoint.save_final_model=true"]
    first = run(command(out, cache, *args), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (out / "metrics.jsonl").read_bytes()
    trained = [json.loads(line) for line in before.decode().splitlines() if '"loss"' in line]
    assert all(r["loss_tokens_per_s"] > 0 and r["peak_flops_source"] in ("measured", "cached") for r in trained)
    again = run(command(out, cache, *args), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert "is complete: step 2 of 2" in said and str(out / "model") in said, said[-2000:]
    assert "resumed from" not in said and "tokens/s" not in said
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("out", ["../usr", "/usr/local/out", "/opt", "../bin", "."])
def test_k8s_never_mounts_the_output_volume_over_the_images_own_directories(capsys, out):
    from overdrive.cli import main

    job = ["launch.num_machines=2", "launch.num_processes=2", "launch.gpus_per_machine=1",
           "launch.image=ghcr.io/example/overdrive:1", f"output_dir={out}"]
    assert main(["k8s", *job]) == 2
    err = capsys.readouterr().err
    assert "- output_dir:" in err and "Traceback" not in err, err
    assert main(["k8s", *job[:-1], "output_dir=runs/mine"]) == 0


@pytest.mark.slow
def test_a_base_from_adapter_config_that_is_nowhere_says_where_it_came_from(adapter, tmp_path):
    import shutil

    moved = tmp_path / "adapter"
    shutil.copytree(adapter, moved)
    config = moved / "adapter_config.json"
    saved = json.loads(config.read_text())
    saved["base_model_name_or_path"] = "models/base"  # relative to where training ran, elsewhere
    config.write_text(json.dumps(saved))
    result = run_cli("merge", str(moved), "-o", str(tmp_path / "merged"), cwd=tmp_path,
                     env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "adapter_config.json" in result.stderr and "--base DIR" in result.stderr, result.stderr
    assert "- --base:" not in result.stderr  # no --base was given


def test_cluster_writers_tune_and_compare_never_write_over_what_they_read(tmp_path, capsys):
    from overdrive.cli import main

    run_yaml = tmp_path / "run.yaml"
    text = "launch:\n  num_machines: 2\n  num_processes: 2\n  gpus_per_machine: 1\n  image: ghcr.io/example/o:1\n"
    run_yaml.write_text(text)
    for argv in (["slurm", str(run_yaml), "-o", str(run_yaml), "--force"],
                 ["k8s", str(run_yaml), "-o", str(run_yaml), "--force"],
                 ["tune", str(run_yaml), "-o", str(run_yaml), "--force"]):
        assert main(argv) == 2, argv
        assert "- --output:" in capsys.readouterr().err and run_yaml.read_text() == text
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 2.0, "time": 1.0}) + "\n")
    kept = metrics.read_bytes()
    assert main(["compare", str(run_dir), str(run_dir), "--plot", str(metrics), "--force"]) == 2
    assert "- --plot:" in capsys.readouterr().err and metrics.read_bytes() == kept


@pytest.mark.slow
def test_a_run_continuing_an_adapter_of_another_base_is_refused_by_peft_adapter_path(adapter, tmp_path):
    from hf_fixtures import make_chat_data

    wide = adapter.parent / "wide"
    chat = make_chat_data(tmp_path / "chat.jsonl", rows=16)
    result = run_cli("train", f"model.name_or_path={wide}", f"peft.adapter_path={adapter}", "peft.method=lora",
                     "peft.r=4", "peft.alpha=8", f"data.source={chat}", "data.format=chat", "data.max_length=32",
                     "training.max_steps=1", "launch.use_cpu=true", "logging.trackers=[none]",
                     f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "peft.adapter_path" in result.stderr and str(adapter) in result.stderr and str(wide) in result.stderr
    assert "state_dict" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_merge_into_a_base_of_another_family_with_the_same_shapes_is_refused(adapter, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig

    llama = AutoModelForCausalLM.from_pretrained(adapter.parent / "base")
    c = llama.config
    mistral = AutoModelForCausalLM.from_config(MistralConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size, tie_word_embeddings=False))
    mistral.save_pretrained(tmp_path / "mistral")
    AutoTokenizer.from_pretrained(adapter.parent / "base").save_pretrained(tmp_path / "mistral")
    result = run_cli("merge", str(adapter), "-o", str(tmp_path / "merged"), "--base", str(tmp_path / "mistral"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "- --base:" in result.stderr and "llama" in result.stderr and "mistral" in result.stderr, result.stderr
    assert not (tmp_path / "merged").exists()
