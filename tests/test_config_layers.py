"""The six layers: precedence, provenance, string parsing, extends, safe YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from overdrive.resolving import load_config, resolve
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError

def _write_all_layers(tmp_path: Path) -> dict:
    """training.gradient_accumulation_steps set differently in every layer."""
    hf_home = tmp_path / "hf"
    (hf_home / "accelerate").mkdir(parents=True)
    # gradient accumulation has no top-level key in Accelerate YAML; Accelerate's env var
    # and the DeepSpeed section carry it, so the default config sets it through the latter.
    (hf_home / "accelerate" / "default_config.yaml").write_text(
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        "  gradient_accumulation_steps: 2\n"
        "  zero_stage: 2\n"
    )
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("training:\n  gradient_accumulation_steps: 3\n")
    return {
        "files": [str(run_yaml)],
        "env": {"HF_HOME": str(hf_home), "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
        "cli": ["accum=5"],
        "overrides": {"training.gradient_accumulation_steps": 6},
    }


def test_each_layer_wins_in_turn(tmp_path):
    layers = _write_all_layers(tmp_path)
    expected = [("override", 6), ("cli", 5), ("env", 4), ("file", 3), ("accelerate-default", 2), ("default", 1)]
    for layer, value in expected:
        resolved = resolve(layers["files"], cli=layers["cli"], overrides=layers["overrides"], env=layers["env"])
        assert resolved.config.training.gradient_accumulation_steps == value
        assert resolved.origins["training.gradient_accumulation_steps"].layer == layer
        # Remove the highest layer for the next round.
        if layer == "override":
            layers["overrides"] = None
        elif layer == "cli":
            layers["cli"] = []
        elif layer == "env":
            layers["env"] = {"HF_HOME": layers["env"]["HF_HOME"]}
        elif layer == "file":
            layers["files"] = []
        elif layer == "accelerate-default":
            layers["env"] = {"HF_HOME": str(tmp_path / "empty")}


@pytest.mark.slow
def test_explain_key_names_the_winning_layer(tmp_path):
    layers = _write_all_layers(tmp_path)
    env = {"HF_HOME": layers["env"]["HF_HOME"], "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    rounds = [
        (layers["files"] + ["accum=5"], env, "cli"),
        (layers["files"], env, "env"),
        (layers["files"], {"HF_HOME": env["HF_HOME"]}, "file"),
        ([], {"HF_HOME": env["HF_HOME"]}, "accelerate-default"),
        ([], {"HF_HOME": str(tmp_path / "none")}, "default"),
    ]
    for items, environment, winner in rounds:
        result = run_cli("explain", *items, "--key", "training.gradient_accumulation_steps", env=environment)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        won = [line for line in lines if "[wins]" in line]
        assert len(won) == 1 and won[0].split()[1] == winner, result.stdout
    # The sixth layer (programmatic overrides) is only reachable from Python.
    resolved = resolve(layers["files"], overrides={"accum": 6}, env=env)
    assert resolved.chains["training.gradient_accumulation_steps"][-1].origin.layer == "override"
    assert [s.origin.layer for s in resolved.chains["training.gradient_accumulation_steps"]] == [
        "default", "accelerate-default", "file", "env", "override"]


def test_file_origins_carry_line_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("# comment\noptim:\n  lr: 3.0e-4\nparallel:\n  strategy: fsdp\n")
    resolved = resolve([path], env={})
    assert str(resolved.origins["optim.lr"]) == f"file {path}:3"
    assert resolved.origins["parallel.strategy"].line == 5
    assert resolved.config.optim.lr == pytest.approx(3e-4)


def test_strings_are_parsed_by_the_field_type():
    env = {"OVERDRIVE_OPTIM__LR": "1e-3", "OVERDRIVE_TRAINING__GRADIENT_CLIPPING": "null",
           "OVERDRIVE_PARALLEL__DEEPSPEED__ZERO_STAGE": "3", "OVERDRIVE_OUTPUT_DIR": "runs/x"}
    cfg = load_config(env=env, cli=["optim.betas=0.8,0.99", "training.micro_batch_size=auto",
                                    "parallel.fsdp.transformer_layer_cls_to_wrap=GPT2Block",
                                    "launch.use_cpu=yes", "model.architecture.n_layer=2"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.training.gradient_clipping is None
    assert cfg.parallel.deepspeed.zero_stage == 3
    assert cfg.output_dir == "runs/x"
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.training.micro_batch_size == "auto"
    assert cfg.parallel.fsdp.transformer_layer_cls_to_wrap == ["GPT2Block"]
    assert cfg.launch.use_cpu is True
    assert cfg.model.architecture["n_layer"] == 2  # one key of an open mapping: the rest kept
    assert cfg.model.architecture["n_embd"] == RunConfig().model.architecture["n_embd"]


def test_overrides_accept_nested_and_dotted_keys():
    cfg = load_config(overrides={"optim": {"lr": 0.5}, "parallel.strategy": "deepspeed", "lr": 0.25})
    assert cfg.optim.lr == 0.25 and cfg.parallel.strategy == "deepspeed"


def test_another_model_type_starts_the_architecture_afresh(tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text("model:\n  architecture:\n    model_type: llama\n    hidden_size: 64\n    num_hidden_layers: 2\n")
    cfg = load_config(path, env={})
    assert cfg.model.architecture == {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}


def test_extends_is_relative_and_cycles_are_reported(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "common.yaml").write_text("optim:\n  lr: 0.1\ntraining:\n  max_steps: 7\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base/common.yaml\noptim:\n  lr: 0.2\n")
    resolved = resolve([child], env={})
    assert resolved.config.optim.lr == 0.2 and resolved.config.training.max_steps == 7
    assert resolved.origins["training.max_steps"].source.endswith("common.yaml")

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("extends: b.yaml\n")
    b.write_text("extends: a.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        resolve([a], env={})


@pytest.mark.slow
def test_python_tags_are_refused_not_executed(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "evil.yaml"
    path.write_text(f"optim:\n  lr: !!python/object/apply:os.system ['touch {marker}']\n")
    result = run_cli("explain", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "unsafe" in result.stderr and f"{path}:2" in result.stderr
    assert not marker.exists()


def test_resolved_round_trips_through_json(tmp_path):
    resolved = resolve([], cli=["lr=0.01"], env={})
    again = type(resolved).from_json(resolved.to_json())
    assert again.config == resolved.config
    assert str(again.origins["optim.lr"]) == "cli lr=0.01"
    assert json.loads(resolved.to_json())["origins"]["optim.lr"] == "cli lr=0.01"
