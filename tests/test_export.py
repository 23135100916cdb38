"""`overdrive export` writes files `accelerate launch` accepts; `overdrive import` reads them
back into the same run config."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import PEER_CONFIGS, REPO, run_cli, run_here

from overdrive.interop import writing as export
from overdrive.resolving import resolve
from overdrive.strategies import deepspeed_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Every key the two formats carry, to compare after a round trip.
CARRIED = ("parallel.strategy", "precision.mixed_precision", "precision.downcast_bf16", "training.micro_batch_size",
           "training.gradient_accumulation_steps", "training.gradient_clipping", "parallel.deepspeed",
           "parallel.fsdp.version", "parallel.fsdp.reshard_after_forward", "parallel.fsdp.offload_params",
           "parallel.fsdp.auto_wrap_policy", "parallel.fsdp.transformer_layer_cls_to_wrap",
           "parallel.fsdp.state_dict_type", "parallel.fsdp.activation_checkpointing",
           "parallel.fsdp.cpu_ram_efficient_loading", "parallel.fsdp.sync_module_states", "compile", "launch")
BATCH = {"training.micro_batch_size", "training.gradient_accumulation_steps", "training.gradient_clipping"}


def resolved_of(*files, cli=()):
    return resolve([str(f) for f in files], cli=list(cli), env={}, accelerate_default=False)


def value_at(cfg, key):
    node = cfg.model_dump(mode="json")
    for part in key.split("."):
        node = node[part]
    return node


def same(a, b):
    # `config_file` records which DeepSpeed JSON the values were read from.
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if k != "config_file"} for d in (a, b))
    return a == b


def accelerate_accepts(acc_path):
    """What `accelerate launch --config_file` does with it, short of starting processes."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    loaded = load_config_from_file(str(acc_path))
    args = launch_command_parser().parse_args(["--config_file", str(acc_path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return loaded, args


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_exported_files_are_accepted_and_round_trip(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Accelerate resolves deepspeed_config_file against the working directory
    cfg = resolved_of(config, cli=["compile.backend=inductor", "compile.mode=max-autotune"]).config
    ds_file = "ds.json" if cfg.parallel.strategy == "deepspeed" else None
    export.write(cfg, "acc.yaml", ds_file)

    loaded, args = accelerate_accepts(tmp_path / "acc.yaml")
    assert loaded.num_processes == cfg.launch.num_processes
    assert loaded.distributed_type.value == export.distributed_type(cfg)
    assert args.dynamo_backend == "INDUCTOR"
    if ds_file:
        assert args.use_deepspeed and loaded.deepspeed_config["deepspeed_config_file"] == "ds.json"
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(hf_ds_config=str(tmp_path / ds_file))
        assert plugin.zero_stage == cfg.parallel.deepspeed.zero_stage

    # Round trip: the files read back as config layers give the same values.
    back = resolved_of(tmp_path / "acc.yaml").config
    # Accelerate's YAML has no batch keys of its own: only a DeepSpeed JSON carries them.
    for key in CARRIED if ds_file else set(CARRIED) - BATCH:
        assert same(value_at(back, key), value_at(cfg, key)), key
    if ds_file:
        assert deepspeed_config.ds_config(back, 2, 64) == deepspeed_config.ds_config(cfg, 2, 64)


@pytest.mark.slow
def test_deepspeed_json_for_a_ddp_run_is_refused(tmp_path):
    done = run_cli("export", str(REPO / "configs" / "ddp.yaml"), "--deepspeed", str(tmp_path / "ds.json"))
    assert done.returncode == 2 and "parallel.strategy" in done.stderr


def test_exported_json_keeps_autos_accelerate_fills(tmp_path):
    cfg = resolved_of(REPO / "configs" / "zero3.yaml").config
    ds = export.deepspeed_json(cfg, batch_auto=True)
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["train_batch_size"] == "auto"
    assert ds["zero_optimization"]["reduce_bucket_size"] == "auto"  # filled from model.config at prepare
    assert ds["gradient_accumulation_steps"] == 1 and ds["bf16"]["enabled"] is True


@pytest.mark.slow
def test_export_then_import_cli(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "parallel": {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu",
                                                            "offload_param": "cpu", "extra": {"steps_per_print": 50}}},
        "precision": {"mixed_precision": "bf16"},
        "training": {"micro_batch_size": 3, "gradient_accumulation_steps": 4, "gradient_clipping": 0.7},
        "launch": {"num_processes": 4, "num_machines": 2, "main_process_ip": "10.1.2.3", "main_process_port": 29999},
    }))
    acc, ds = tmp_path / "acc.yaml", tmp_path / "ds.json"
    done = run_cli("export", str(run), "--accelerate", str(acc), "--deepspeed", str(ds))
    assert done.returncode == 0, done.stderr
    assert json.loads(ds.read_text())["steps_per_print"] == 50
    imported = tmp_path / "imported.yaml"
    done = run_cli("import", str(acc), "-o", str(imported))
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout  # what export writes, import reads without complaint
    written = yaml.safe_load(imported.read_text())
    assert written["launch"]["main_process_ip"] == "10.1.2.3"
    assert "optim" not in written and "model" not in written  # only what differs from the defaults
    original, back = resolved_of(run).config, resolved_of(imported).config
    for key in CARRIED:
        assert same(value_at(back, key), value_at(original, key)), key


@pytest.mark.slow
def test_files_the_user_has_are_kept_unless_forced(tmp_path):
    run, acc = tmp_path / "run.yaml", tmp_path / "acc.yaml"
    run.write_text("optim:\n  lr: 3.0e-4\n")
    assert run_cli("export", str(run), "--accelerate", str(acc)).returncode == 0
    before = {path: path.read_text() for path in (run, acc)}
    for args in (["import", str(acc), "-o", str(run)], ["export", str(run), "--accelerate", str(acc)],
                 ["slurm", str(run), "-o", str(run)]):
        done = run_cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, args
        if args[-1] == args[1]:  # the output is the input it reads: refused even with --force (storage/overlap.py)
            assert "refused even with --force" in done.stderr
        else:
            assert "exists and would be overwritten" in done.stderr and "--force" in done.stderr
        assert {path: path.read_text() for path in (run, acc)} == before
    done = run_cli("export", str(run), "--accelerate", str(acc), "precision.mixed_precision=bf16", "--force")
    assert done.returncode == 0, done.stderr
    assert "bf16" in acc.read_text()


@pytest.mark.slow
def test_import_writes_only_non_defaults_of_a_peer_file(tmp_path):
    out = tmp_path / "run.yaml"
    done = run_cli("import", str(PEER_CONFIGS / "accelerate" / "examples" / "config_yaml_templates" / "fsdp.yaml"),
                   "-o", str(out))
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load(out.read_text())
    assert written["parallel"]["strategy"] == "fsdp"
    assert written["precision"]["mixed_precision"] == "bf16"
    assert written["launch"]["num_processes"] == 2
    assert "reshard_after_forward" not in written["parallel"].get("fsdp", {})  # FULL_SHARD: the default


def test_export_peft_refused_by_key_makes_no_directory(tmp_path):
    target = tmp_path / "adapter" / "config"
    done = run_here("export", "peft.method=none", "--peft", str(target))
    assert done.returncode == 2 and "peft.method" in done.stderr, done.stderr
    assert not (tmp_path / "adapter").exists()
