"""The rules that need the model's config (resolving/validate_model.py), judged by explain and train
before anything launches or loads weights, every problem in one message (no training here)."""

from __future__ import annotations

import pytest

from hf_fixtures import make_text_data, make_tiny_llama, make_tiny_qwen3_moe
from overdrive.errors import UserError
from overdrive.resolving import resolve
from overdrive.resolving.validate_model import explained
from overdrive.training.build.preconditions import before_launch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_tiny_llama(root / "llama"), make_tiny_qwen3_moe(root / "moe")  # 128 and 64 positions; 4 experts


@pytest.fixture
def text(tmp_path):
    return make_text_data(tmp_path / "text.jsonl")


def _keys(rules, *cli) -> list[str]:
    with pytest.raises(UserError) as error:
        resolve((), cli=list(cli), env={}, rules=rules)
    return [p.key for p in error.value.problems]


@pytest.mark.parametrize("rules", [explained, before_launch], ids=["explain", "train"])
def test_model_moe_keys_on_a_dense_pretrained_model_are_refused_by_explain_as_by_train(models, text, rules, tmp_path):
    llama, _ = models
    keys = _keys(rules, f"model.name_or_path={llama}", f"data.source={text}", "model.moe.top_k=2",
                 "launch.use_cpu=true", f"output_dir={tmp_path / 'out'}")
    assert "model.moe.top_k" in keys
    # without the rules (plain resolve, as before) nothing is read of the model
    resolve((), cli=[f"model.name_or_path={llama}", f"data.source={text}", "model.moe.top_k=2"], env={})


def test_explain_refuses_what_the_model_config_forbids_and_names_where_it_was_set(models, text, tmp_path):
    llama, moe = models
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{name_or_path: {moe}}}\ndata: {{source: {text}, max_length: 256}}\n"
                   "parallel: {ep_size: 3}\nlaunch: {num_processes: 3}\ncheckpoint: {enabled: false}\n")
    with pytest.raises(UserError) as error:
        resolve([run], env={}, rules=explained)
    text_ = error.value.render()
    assert "data.max_length: 256 is longer than the model's 64 positions" in text_
    assert "parallel.ep_size: the model's 4 experts do not divide by 3" in text_
    assert f"{run}:2" in text_ or "run.yaml:2" in text_  # where data.max_length was set


def test_train_reports_every_problem_of_a_config_in_one_error_before_loading_weights(models, text, tmp_path):
    llama, _ = models
    keys = _keys(before_launch, f"model.name_or_path={llama}", f"data.source={text}", "launch.use_cpu=true",
                 "model.attn_implementation=flash_attention_2",  # the resolver's rule (CPU run)
                 "data.max_length=256",  # the model's config: 128 positions
                 "model.moe.top_k=2",  # the model's config: no experts
                 "training.micro_batch_size=64", "training.global_batch_size=100",  # the batch split
                 f"output_dir={tmp_path / 'out'}")
    assert set(keys) >= {"model.attn_implementation", "data.max_length", "model.moe.top_k",
                         "training.global_batch_size"}, keys


def test_an_inline_architecture_is_judged_from_its_mapping_without_transformers(monkeypatch):
    import overdrive.resolving.validate_model as rules

    monkeypatch.setattr(rules, "read", lambda cfg: pytest.fail("the model config was read"))
    assert _keys(explained, "data.max_length=2048") == ["data.max_length"]  # the embedded GPT-2: 1024 positions
    resolve((), cli=["data.max_length=1024"], env={}, rules=explained)


def test_a_model_explain_cannot_read_here_is_a_warning_and_an_error_for_train(tmp_path):
    missing = tmp_path / "no-model"
    missing.mkdir()  # a directory without config.json
    resolved = resolve((), cli=[f"model.name_or_path={missing}"], env={}, rules=explained)
    assert any(p.key == "model.name_or_path" and "not checked" in p.message for p in resolved.warnings)
    assert "model.name_or_path" in _keys(before_launch, f"model.name_or_path={missing}", "launch.use_cpu=true",
                                         f"output_dir={tmp_path / 'out'}")


def test_each_estimator_row_is_the_settings_its_strategy_names_back():
    from overdrive.config.keys import set_dotted
    from overdrive.config.schema import RunConfig
    from overdrive.memory.formulas import STRATEGIES
    from overdrive.strategies import registry

    for row in STRATEGIES:
        raw = RunConfig().model_dump(mode="json")
        for key, value in registry.row_settings(row).items():
            set_dotted(raw, key, value)
        cfg = RunConfig.model_validate(raw)
        assert registry.of(cfg).estimator_row(cfg) == row


def _estimate(capsys, *args) -> dict:
    import json

    from overdrive.cli import main

    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_marks_the_rows_train_would_refuse_and_refuses_what_every_row_would(models, capsys):
    from overdrive.cli import main

    _, moe = models
    rows = {r["strategy"]: r for r in _estimate(capsys, str(moe), "--ep", "2", "--devices", "2")["rows"]}
    zero = [name for name in rows if name.startswith("zero")]
    assert zero and all(rows[name]["refused"].startswith("parallel.ep_size: expert parallel is composed with ddp "
                                                         "and fsdp here, not with deepspeed") for name in zero)
    assert all(not rows[name]["fits"] for name in zero)
    assert all(rows[name]["refused"] is None and rows[name]["fits"] for name in ("ddp", "fsdp2", "fsdp2_offload"))
    assert main(["estimate", str(moe), "--ep", "3", "--devices", "2"]) == 2  # 4 experts over 3 ranks, 2 processes
    err = capsys.readouterr().err
    assert "parallel.ep_size: the model's 4 experts do not divide by 3  [--ep 3]" in err
    assert "3 does not divide the data-parallel degree 2" in err


def test_train_counts_rl_prompts_against_the_global_batch_with_every_other_problem(models, tmp_path):
    import json

    llama, _ = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "ok") * 8))
    keys = _keys(before_launch, f"model.name_or_path={llama}", f"data.source={prompts}", "data.format=prompts",
                 "rl.method=grpo", "rl.num_generations=4", "rl.reward_funcs=[{function: exact_match, column: answer}]",
                 "training.micro_batch_size=4", "training.gradient_accumulation_steps=32",  # 128 > 16 x 4 completions
                 "data.max_length=512", "model.attn_implementation=flash_attention_2", "launch.use_cpu=true",
                 f"output_dir={tmp_path / 'out'}")
    assert set(keys) == {"model.attn_implementation", "data.max_length", "training.micro_batch_size"}, keys


@pytest.mark.slow
def test_data_too_small_for_a_global_batch_is_refused_before_the_model_is_built(models, text, tmp_path):
    from conftest import run_cli

    llama, _ = models
    done = run_cli("train", f"model.name_or_path={llama}", f"data.source={text}", "data.max_length=64",
                   "training.micro_batch_size=64", "training.max_steps=2", "launch.use_cpu=true",
                   f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}")
    assert done.returncode == 2 and "fewer than one global batch" in done.stderr, done.stderr
    assert "building the model" not in done.stderr and "Loading weights" not in done.stderr


def test_what_the_built_model_would_refuse_is_read_from_its_config_before_launch():
    # A class without gradient checkpointing (a class attribute: no model is built) ...
    ctrl = ["model.architecture={model_type: ctrl, n_layer: 1, n_embd: 32, n_head: 2, n_positions: 512}",
            "model.gradient_checkpointing=true"]
    assert _keys(explained, *ctrl) == ["model.gradient_checkpointing"]
    # ... and a loss kernel asked for by name on a model that rescales its logits after the head (Gemma-2).
    gemma = ["model.architecture={model_type: gemma2, num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64, "
             "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 512}",
             "training.loss_kernel=chunked"]
    assert _keys(explained, *gemma) == ["training.loss_kernel"]
    resolve((), cli=[*gemma[:1], "training.loss_kernel=full"], env={}, rules=explained)
