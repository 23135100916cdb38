"""Every input accepted correctly or refused clearly: exit 2 naming the key or file, or the
value applied; never a traceback, never a secret in what is printed or written.

In-process through `cli.main` (fast); the few that need a fresh interpreter say why.
"""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from conftest import run_cli
import yaml


from overdrive import cli

TOKEN = "hf_PlantedTokenAbcdefghijklmnop1234"


def od(*args: str, env: dict | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """`overdrive ARGS` in this process: (exit code, stdout, stderr)."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(args))
    for name in env or {}:
        monkeypatch.delenv(name)
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return code, out.getvalue(), err.getvalue()


def refused(*args: str, naming: str | tuple[str, ...], env: dict | None = None, monkeypatch=None) -> str:
    code, out, err = od(*args, env=env, monkeypatch=monkeypatch)
    assert code == 2, (out, err)
    for word in [naming] if isinstance(naming, str) else naming:
        assert word in err, err
    return err


def explain_json(*args: str, env: dict | None = None, monkeypatch=None) -> dict:
    code, out, err = od("explain", "--json", *args, env=env, monkeypatch=monkeypatch)
    assert code == 0, err
    return json.loads(out)


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# --------------------------------------------------------------------------- values dropped or bent


def test_architecture_mapping_on_the_command_line_is_merged_over_the_default(monkeypatch):
    data = explain_json('model.architecture={"n_layer": 2, "n_head": 2}', monkeypatch=monkeypatch)
    arch = data["config"]["model"]["architecture"]
    assert arch["n_layer"] == 2 and arch["n_head"] == 2 and arch["n_embd"] == 128  # merged, not replaced
    assert data["origins"]["model.architecture.n_layer"].startswith("cli")


def test_architecture_mapping_in_the_environment_is_applied(monkeypatch):
    data = explain_json(env={"OVERDRIVE_MODEL__ARCHITECTURE": "{n_layer: 3}"}, monkeypatch=monkeypatch)
    assert data["config"]["model"]["architecture"]["n_layer"] == 3
    assert "OVERDRIVE_MODEL__ARCHITECTURE" in data["origins"]["model.architecture.n_layer"]


@pytest.mark.parametrize("value", ["5", "[1, 2]", "n_layer", "{n_layer: 2"])
def test_architecture_that_is_not_a_mapping_is_refused_on_the_command_line(value, monkeypatch):
    refused("explain", f"model.architecture={value}", naming="model.architecture", monkeypatch=monkeypatch)


def test_architecture_that_is_not_a_mapping_is_refused_in_a_file(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", "model:\n  architecture: 5\n")
    refused("explain", str(path), naming=("model.architecture", "mapping"), monkeypatch=monkeypatch)


def test_a_key_written_twice_names_both_lines(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", "optim:\n  lr: 0.01\ntraining:\n  max_steps: 3\noptim:\n  eps: 1.0e-6\n")
    refused("explain", str(path), naming=("optim", "lines 1 and 5", str(path)), monkeypatch=monkeypatch)
    nested = write(tmp_path / "nested.yaml", "optim:\n  lr: 0.01\n  lr: 0.02\n")
    refused("explain", str(nested), naming=("lr", "lines 2 and 3"), monkeypatch=monkeypatch)
    as_json = write(tmp_path / "ds.json", '{"train_batch_size": 8,\n "train_batch_size": 16}')
    refused("explain", str(as_json), naming=("train_batch_size", "twice"), monkeypatch=monkeypatch)


@pytest.mark.parametrize("item", ["steps=true", "training.micro_batch_size=true", "zero_stage=true",
                                  "launch.num_processes=false", "training.seed=true"])
def test_a_boolean_is_not_taken_for_a_number_on_the_command_line(item, monkeypatch):
    refused("explain", item, naming=item.split("=")[0].split(".")[-1], monkeypatch=monkeypatch)


def test_a_boolean_is_not_taken_for_a_number_in_a_file(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", "training:\n  max_steps: true\nparallel:\n  deepspeed:\n    zero_stage: true\n")
    refused("explain", str(path), naming=("training.max_steps", "parallel.deepspeed.zero_stage", "boolean"),
            monkeypatch=monkeypatch)


@pytest.mark.parametrize("item", ["optim.lr=inf", "optim.weight_decay=inf", "training.gradient_clipping=inf",
                                  "optim.lr=nan", "optim.eps=-inf", "scheduler.min_lr_ratio=nan",
                                  "launch.monitor_interval=inf"])
def test_non_finite_floats_are_refused(item, monkeypatch):
    refused("explain", item, naming=item.split("=")[0], monkeypatch=monkeypatch)


def test_non_finite_floats_are_refused_in_a_file(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", "optim:\n  lr: .inf\n  betas: [0.9, .nan]\n")
    refused("explain", str(path), naming=("optim.lr", "optim.betas"), monkeypatch=monkeypatch)


@pytest.mark.parametrize("seed", ["-1", str(2**32), "1e20"])
def test_seeds_numpy_refuses_are_refused(seed, monkeypatch):
    refused("explain", f"training.seed={seed}", naming="training.seed", monkeypatch=monkeypatch)


def test_the_largest_seed_numpy_accepts_is_accepted(monkeypatch):
    import numpy as np

    assert explain_json(f"seed={2**32 - 1}", monkeypatch=monkeypatch)["config"]["training"]["seed"] == 2**32 - 1
    np.random.seed(2**32 - 1)
    with pytest.raises(ValueError):
        np.random.seed(2**32)


def test_misspelled_deepspeed_keys_at_any_depth_are_refused_with_did_you_mean(tmp_path, monkeypatch):
    path = write(tmp_path / "ds.json", json.dumps({
        "train_micro_batch_size_per_gpu": 8, "gradient_clippin": 1.0,
        "zero_optimization": {"stage": 2, "overlap_com": True,
                              "offload_optimizer": {"device": "cpu", "pinn_memory": True}},
        "bf16": {"enabled": "auto", "enabeld": True},
        "activation_checkpointing": {"partition_activation": True}, "flops_profiler": {"profil_step": 2},
    }, indent=1))
    err = refused("explain", str(path), naming=(
        "gradient_clippin", "`gradient_clipping`", "zero_optimization.overlap_com", "`overlap_comm`",
        "zero_optimization.offload_optimizer.pinn_memory", "`pin_memory`", "bf16.enabeld", str(path),
        "activation_checkpointing.partition_activation", "`partition_activations`", "`profile_step`"),
        monkeypatch=monkeypatch)
    assert f"{path}:6]" in err and f"{path}:3]" in err  # the lines of overlap_com and gradient_clippin


def test_deepspeed_blocks_of_the_wrong_shape_or_removed_are_refused(tmp_path, monkeypatch):
    path = write(tmp_path / "ds.json", json.dumps({"zero_optimization": {"stage": 1, "mics_shard_size": 2},
                                                    "wandb": 5, "amp": {"enabled": True},
                                                    "optimizer": {"type": "AdamW", "params": 5}}))
    refused("explain", str(path), naming=("wandb", "optimizer.params", "amp: removed from DeepSpeed",
                                          "zero_optimization.mics_shard_size: removed"), monkeypatch=monkeypatch)


@pytest.mark.slow
def test_deepspeed_model_keys_read_from_source_match_its_pydantic_models():
    # The keys are read from DeepSpeed's source without importing it (seconds): the same
    # names as the imported models give, field names and aliases, for every block.
    import importlib

    from overdrive.interop import deepspeed_schema as schema

    modules = ["deepspeed.runtime.zero.config", "deepspeed.runtime.precision_config", "deepspeed.monitor.config",
               "deepspeed.comm.config", "deepspeed.compile.config", "deepspeed.runtime.config",
               "deepspeed.runtime.tensor_parallel.config"]
    loaded = [importlib.import_module(name) for name in modules]
    for section, name in schema.SECTION_MODELS.items():
        model = next(getattr(module, name) for module in loaded if hasattr(module, name))
        names = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
        assert set(schema._fields(name)) == names, section
    zero = schema.models()["DeepSpeedZeroConfig"]
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    assert set(schema._fields("DeepSpeedZeroOffloadOptimizerConfig", zero)) == set(DeepSpeedZeroOffloadOptimizerConfig.model_fields)


def test_a_correct_deepspeed_json_still_maps_its_extras(tmp_path, monkeypatch):
    path = write(tmp_path / "ds.json", json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True,
                                                                         "round_robin_gradients": True},
                                                    "steps_per_print": 7, "wandb": {"enabled": False}}))
    data = explain_json(str(path), monkeypatch=monkeypatch)
    ds = data["config"]["parallel"]["deepspeed"]
    assert ds["zero_stage"] == 3 and ds["overlap_comm"] is True and ds["extra"]["steps_per_print"] == 7
    assert ds["extra"]["zero_optimization"]["round_robin_gradients"] is True


def test_deepspeed_config_file_pointing_at_an_accelerate_yaml_is_refused(tmp_path, monkeypatch):
    other = write(tmp_path / "other.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    main = write(tmp_path / "acc.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                                        f"deepspeed_config:\n  deepspeed_config_file: {other.name}\n")
    refused("explain", str(main), naming=("deepspeed_config_file", "not a DeepSpeed JSON", str(main)),
            monkeypatch=monkeypatch)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# and another\n", "---\n", "null\n"])
def test_an_empty_or_comments_only_file_is_refused(text, tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", text)
    refused("explain", str(path), naming=(str(path), "empty"), monkeypatch=monkeypatch)


def test_explain_shows_values_set_under_open_mappings(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", "model:\n  architecture:\n    n_layer: 2\nparallel:\n  deepspeed:\n"
                                        "    extra:\n      steps_per_print: 7\n")
    for flags in ((), ("--all",)):
        code, out, err = od("explain", str(path), *flags, monkeypatch=monkeypatch)
        assert code == 0, err
        assert any(line.startswith("model.architecture.n_layer") and " 2 " in line + " " for line in out.splitlines())
        assert any(line.startswith("parallel.deepspeed.extra.steps_per_print") for line in out.splitlines())


def test_a_file_may_not_label_itself_with_another_layers_name(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", "layer: default\noptim:\n  lr: 0.01\n")
    refused("explain", str(path), naming=("layer", "default", str(path)), monkeypatch=monkeypatch)
    labelled = write(tmp_path / "tuned.yaml", "layer: tune\noptim:\n  lr: 0.01\n")
    code, out, _ = od("explain", str(labelled), monkeypatch=monkeypatch)
    assert code == 0 and any(line.startswith("optim.lr") and "tune" in line for line in out.splitlines())


# --------------------------------------------------------------------------- clear messages, not tracebacks


def test_invalid_utf8_in_a_config_names_the_file_and_byte(tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", b"optim:\n  lr: 0.01 # caf\xe9\n")
    refused("explain", str(path), naming=(str(path), "not UTF-8", "offset 23", "line 2, column 17"), monkeypatch=monkeypatch)


def test_invalid_utf8_in_accelerates_default_config(tmp_path, monkeypatch):
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    write(default, b"distributed_type: MULTI_CPU\nnum_processes: \xff\n")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    refused("explain", naming=(str(default), "not UTF-8"), monkeypatch=monkeypatch)
    code, out, err = od("env", "--no-hardware", monkeypatch=monkeypatch)
    assert code == 0 and "not UTF-8" in out and str(default) in out


@pytest.mark.parametrize("extends", ["5", "[null]", "[1, 2]", "{a: b}", "''"])
def test_extends_must_name_files(extends, tmp_path, monkeypatch):
    path = write(tmp_path / "run.yaml", f"extends: {extends}\noptim:\n  lr: 0.01\n")
    refused("explain", str(path), naming=("extends", str(path)), monkeypatch=monkeypatch)


def test_accelerate_num_processes_that_is_not_a_number(tmp_path, monkeypatch):
    path = write(tmp_path / "acc.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: abc\n")
    refused("explain", str(path), naming=("num_processes", str(path)), monkeypatch=monkeypatch)


@pytest.mark.parametrize("section", ["deepspeed_config: 5", "fsdp_config: [a]", "dynamo_config: x", "fp8_config: 3"])
def test_accelerate_sections_that_are_not_mappings(section, tmp_path, monkeypatch):
    path = write(tmp_path / "acc.yaml", f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n{section}\n")
    refused("explain", str(path), naming=(section.split(":")[0], "mapping"), monkeypatch=monkeypatch)


@pytest.mark.parametrize("value", ["abc", "3", "1.5", "true"])
def test_fsdp_version_from_the_environment(value, monkeypatch):
    refused("explain", naming=("fsdp_version", "FSDP_VERSION"),
            env={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": value}, monkeypatch=monkeypatch)


def test_a_2000_deep_value_is_refused_in_files_and_on_the_command_line(tmp_path, monkeypatch):
    deep = "[" * 2000 + "]" * 2000
    path = write(tmp_path / "run.yaml", f"model:\n  architecture:\n    x: {deep}\n")
    refused("explain", str(path), naming=("nested", str(path)), monkeypatch=monkeypatch)
    as_json = write(tmp_path / "ds.json", '{"steps_per_print": ' + deep + "}")
    refused("explain", str(as_json), naming=("nested", str(as_json)), monkeypatch=monkeypatch)
    refused("explain", f"model.architecture.x={deep}", naming="nested", monkeypatch=monkeypatch)
    refused("explain", "model.architecture=" + "{a: " * 2000 + "1" + "}" * 2000, naming="nested",
            monkeypatch=monkeypatch)


def test_aliases_that_expand_to_millions_are_refused_quickly(tmp_path, monkeypatch):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    path = write(tmp_path / "bomb.yaml", "model:\n  architecture:\n" + "".join(f"    {line}\n" for line in lines))
    start = time.perf_counter()
    refused("explain", "--json", str(path), naming=("expands", str(path)), monkeypatch=monkeypatch)
    assert time.perf_counter() - start < 5


def test_train_output_dir_that_is_a_file_or_unwritable(tmp_path, monkeypatch):
    afile = write(tmp_path / "afile", "x")
    refused("train", f"output_dir={afile}", "training.max_steps=1", naming=("output_dir", str(afile)),
            monkeypatch=monkeypatch)
    refused("train", f"output_dir={afile}/sub", naming="output_dir", monkeypatch=monkeypatch)
    refused("train", "output_dir=/proc/overdrive-test/run", naming="output_dir", monkeypatch=monkeypatch)
    assert afile.read_text() == "x"


def test_export_report_and_plot_targets(tmp_path, monkeypatch):
    refused("export", "--accelerate", str(tmp_path), naming=("--accelerate", "directory"), monkeypatch=monkeypatch)
    refused("export", "--deepspeed", "/proc/overdrive-test/ds.json", naming="--deepspeed", monkeypatch=monkeypatch)
    refused("estimate", "gpt2", "--plot", str(tmp_path), naming="--plot", monkeypatch=monkeypatch)
    refused("compare", "a", "b", "--plot", "/proc/overdrive-test/x.png", naming="--plot", monkeypatch=monkeypatch)
    run = _fake_run(tmp_path / "run")
    afile = write(tmp_path / "afile", "x")
    refused("report", str(run), "-o", str(afile), naming=("-o", str(afile)), monkeypatch=monkeypatch)
    refused("report", str(run), "-o", "/proc/overdrive-test/report", naming="-o", monkeypatch=monkeypatch)


def _fake_run(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    lines = [{"step": step, "loss": 5.0 - step / 10, "lr": 1e-3, "tokens_per_s": 1000.0} for step in range(1, 6)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if config is not None:
        (path / "resolved.json").write_text(json.dumps({"config": config, "origins": {
            "parallel.deepspeed.extra.hub_token": f"cli parallel.deepspeed.extra.hub_token={TOKEN}"}}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("content", [None, "{garbled", '{"config": {"optim": {"lr": "fast"}}}', '["a"]',
                                     b"\xff\xfe"])
def test_train_resolved_that_is_missing_garbled_or_invalid(content, tmp_path):
    # A fresh interpreter: a worker leaves through os._exit, which would end this test process.
    path = tmp_path / "resolved.json"
    if content is not None:
        write(path, content)
    result = run_cli("train", "--resolved", str(path))
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_gpu_memory_must_be_finite_and_positive(value, monkeypatch):
    refused("estimate", "gpt2", f"--gpu-memory={value}", naming="--gpu-memory", monkeypatch=monkeypatch)
    refused("plan", f"--gpu-memory={value}", naming="--gpu-memory", monkeypatch=monkeypatch)


# --------------------------------------------------------------------------- secrets and files


def test_explain_masks_secrets_by_name_and_shape_everywhere(monkeypatch):
    args = [f"parallel.deepspeed.extra.hub_token={TOKEN}", f"model.architecture.tags=[a, {TOKEN}]",
            "data.source=https://alice:s3cretpass@example.org/data.txt"]
    for flags in (("--all",), ("--json",), ("--key", "model.architecture.tags"), ()):
        code, out, err = od("explain", *flags, *args, monkeypatch=monkeypatch)
        assert code == 0, err
        assert TOKEN not in out + err and "s3cretpass" not in out + err
    data = explain_json(*args, monkeypatch=monkeypatch)
    assert data["config"]["model"]["architecture"]["tags"] == ["a", "***"]  # inside a list
    assert data["config"]["data"]["source"] == "https://***@example.org/data.txt"


def test_error_messages_mask_secrets(monkeypatch):
    err = refused("explain", f"launch.main_process_port={TOKEN}", naming="launch.main_process_port",
                  monkeypatch=monkeypatch)
    assert TOKEN not in err


def test_conflict_messages_mask_secrets(tmp_path, monkeypatch):
    ds = write(tmp_path / "ds.json", json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    err = refused("explain", str(ds), "clip=0.5", f"parallel.deepspeed.extra.hub_token={TOKEN}",
                  naming="training.gradient_clipping", monkeypatch=monkeypatch)
    assert TOKEN not in err


def test_report_summary_and_compare_mask_secrets_of_an_older_run(tmp_path, monkeypatch):
    config = {"optim": {"lr": 0.001}, "parallel": {"deepspeed": {"extra": {"hub_token": TOKEN}}},
              "data": {"source": f"https://user:{TOKEN}@host/x"}}
    a = _fake_run(tmp_path / "a", config)
    b = _fake_run(tmp_path / "b", {**config, "optim": {"lr": 0.002}})
    code, out, err = od("report", str(a), "--print", monkeypatch=monkeypatch)
    assert code == 0, err
    assert TOKEN not in out + err and TOKEN not in (a / "report" / "summary.md").read_text()
    for flags in ((), ("--json",), ("-v",)):
        code, out, err = od("compare", str(a), str(b), *flags, monkeypatch=monkeypatch)
        assert code == 0, err
        assert TOKEN not in out + err


def test_resolved_json_masks_secrets_and_a_worker_gets_them_from_its_environment(monkeypatch):
    from overdrive.resolving import SECRETS_VARIABLE, Resolved, resolve

    resolved = resolve(cli=[f"parallel.deepspeed.extra.hub_token={TOKEN}"], env={})
    text = resolved.to_json()
    assert TOKEN not in text
    assert resolved.secret_values() == {"parallel.deepspeed.extra.hub_token": TOKEN}
    worker = Resolved.from_json(text, environ={SECRETS_VARIABLE: json.dumps(resolved.secret_values())})
    assert worker.config.parallel.deepspeed.extra["hub_token"] == TOKEN
    assert Resolved.from_json(text, environ={}).config.parallel.deepspeed.extra["hub_token"] == "***"


def test_trainer_state_config_is_masked_and_resume_sees_no_change():
    from overdrive.checkpoint import fingerprint as fp
    from overdrive.resolving import resolve

    from overdrive.config.redact import redact
    from overdrive.config.stored import read_stored

    config = resolve(cli=[f"parallel.deepspeed.extra.hub_token={TOKEN}"], env={}).config
    stored = redact(config.model_dump(mode="json"))
    assert TOKEN not in json.dumps(stored)
    assert not fp.compare(read_stored({"config": stored}, "trainer_state.json"), config).changes


def test_export_same_path_twice_and_existing_files(tmp_path, monkeypatch):
    same = tmp_path / "x.cfg"
    refused("export", "--accelerate", str(same), "--deepspeed", str(same), naming=("--deepspeed", "same file"),
            monkeypatch=monkeypatch)
    assert not same.exists()
    existing = write(tmp_path / "acc.yaml", "mine")
    refused("export", "--accelerate", str(existing), naming=(str(existing), "--force"), monkeypatch=monkeypatch)
    assert existing.read_text() == "mine"
    code, out, err = od("export", "--accelerate", str(existing), "--force", f"parallel.deepspeed.extra.hub_token={TOKEN}",
                        "strategy=deepspeed", "--deepspeed", str(tmp_path / "ds.json"), monkeypatch=monkeypatch)
    assert code == 0, err
    assert out == ""  # messages on stderr
    assert TOKEN not in existing.read_text() + (tmp_path / "ds.json").read_text()


def test_plots_do_not_overwrite_without_force(tmp_path, monkeypatch):
    plot = write(tmp_path / "mine.png", "mine")
    refused("estimate", "gpt2", "--plot", str(plot), naming=(str(plot), "--force"), monkeypatch=monkeypatch)
    refused("compare", "a", "b", "--plot", str(plot), naming=(str(plot), "--force"), monkeypatch=monkeypatch)
    assert plot.read_text() == "mine"


def test_import_writes_only_yaml_to_stdout(tmp_path, monkeypatch):
    acc = write(tmp_path / "acc.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
                                       "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    code, out, err = od("import", str(acc), monkeypatch=monkeypatch)
    assert code == 0, err
    assert "warning" in err  # no fsdp_version: told, on stderr
    data = yaml.safe_load(out)
    assert data["parallel"]["strategy"] == "fsdp" and data["launch"]["num_processes"] == 2


@pytest.mark.parametrize("name", ["a\nrm -rf ~", "a;reboot", "$(id)", "a b", "`x`", "a'b", "", "-x"])
def test_slurm_job_name_is_a_plain_name(name, monkeypatch):
    refused("slurm", f"--job-name={name}", naming="--job-name", monkeypatch=monkeypatch)


def test_slurm_job_name_plain_is_accepted(monkeypatch):
    code, out, err = od("slurm", "--job-name", "my-run_1.2", monkeypatch=monkeypatch)
    assert code == 0, err
    assert "#SBATCH --job-name=my-run_1.2\n" in out


# --------------------------------------------------------------------------- the error boundary


def test_an_unforeseen_error_is_one_line_and_a_traceback_file(monkeypatch):
    from overdrive.commands import explain

    def broken(args):
        raise RuntimeError(f"something broke near {TOKEN}")

    monkeypatch.setattr(explain, "run", broken)
    code, out, err = od("explain", monkeypatch=monkeypatch)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "internal error" in err and "overdrive explain" in err and TOKEN not in err
    saved = Path(err.split("the full traceback is in ")[1].split(" ")[0])
    assert "Traceback" in saved.read_text() and "RuntimeError" in saved.read_text() and TOKEN not in saved.read_text()
    assert oct(saved.stat().st_mode & 0o777) == "0o600"
    saved.unlink()
    monkeypatch.setenv("OVERDRIVE_DEBUG", "1")
    out, err_io = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err_io):
        assert cli.main(["explain"]) == 1
    assert "Traceback" in err_io.getvalue()
    Path(err_io.getvalue().split("the full traceback is in ")[1].split(" ")[0]).unlink()


def test_names_that_only_begin_like_a_token_are_not_masked():
    # A directory named hf_scripts0 or a package named sk-learn is a value the run needs.
    from overdrive.config.redact import redact

    values = {"output_dir": "/tmp/hf_scripts0/run", "data": {"source": "sk-learn-notes.txt"}}
    assert redact(values) == values
    assert redact({"output_dir": f"/tmp/{TOKEN}/run"})["output_dir"] == "/tmp/***/run"
