"""`overdrive launch` of unchanged Transformers Trainer and TRL scripts at 2 CPU processes:
the Trainer's own accelerator gets the configured strategy, processes, precision and ZeRO
stage, the configured accumulation is applied (or the disagreement is named), and a script
taking everything from `overdrive.hf.training_arguments(cfg)` trains with the config's values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from hf_fixtures import make_text_data, make_tiny_model
from strategy_probe import REPO, free_port

pytestmark = pytest.mark.slow

TRAINER = REPO / "examples" / "train_trainer.py"
TRL = REPO / "examples" / "train_trl.py"
# strategy -> (shipped config, extra -s items, Accelerate's distributed type, ZeRO stage). ZeRO-2 is
# test_training_arguments_from_the_config's run: the same Trainer example, checked the same way.
STRATEGIES = {
    "ddp": ("ddp.yaml", [], "MULTI_CPU", None),
    "zero3": ("zero3.yaml", ["precision.mixed_precision=no"], "DEEPSPEED", 3),
    "fsdp2": ("fsdp.yaml", [], "FSDP", None),
}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "OVERDRIVE_"))}


def launch(config: list[str], sets: list[str], script, script_args: list[str], cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "overdrive.cli", "launch", *[a for c in config for a in ("-c", c)],
               *[a for s in sets + ["launch.use_cpu=true", f"launch.main_process_port={free_port()}"]
                 for a in ("-s", s)], str(script), *script_args]
    return subprocess.run(command, capture_output=True, text=True, timeout=400, env=_env(), cwd=cwd)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_scripts")
    return base, make_tiny_model(base / "model"), make_text_data(base / "train.jsonl")


@pytest.fixture(scope="module")
def trainer_runs(assets):
    """The Trainer example under each strategy, accumulation 2 from the config. Under DDP the
    script also passes its own gradient_accumulation_steps=1: a conflict to be named."""
    base, model, data = assets
    runs = {}
    for name, (config, extra, _, _) in STRATEGIES.items():
        out = base / name
        own = ["--gradient-accumulation-steps", "1"] if name == "ddp" else []
        done = launch([str(REPO / "configs" / config)],
                      ["training.gradient_accumulation_steps=2", "training.micro_batch_size=2", "training.max_steps=3",
                       f"output_dir={out}", *extra],
                      TRAINER, ["--model", str(model), "--data", str(data), "--output-dir", str(out),
                                "--max-steps", "3", "--report", str(out / "report.json"), *own], base)
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
        runs[name] = (done, report)
    return runs


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_trainers_accelerator_is_configured(trainer_runs, name):
    done, report = trainer_runs[name]
    _, extra, distributed_type, zero_stage = STRATEGIES[name]
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr and "mismatch TrainingArguments" not in done.stderr
    assert report["distributed_type"] == distributed_type
    assert report["num_processes"] == 2
    precision = "no" if "precision.mixed_precision=no" in extra else "bf16"
    assert report["mixed_precision"] == precision and report["args"]["bf16"] == (precision == "bf16")
    assert report["zero_stage"] == zero_stage
    if zero_stage:
        assert report["ds_bf16"] == (precision == "bf16") and report["ds_gradient_accumulation_steps"] == 2
    if name == "fsdp2":
        assert report["fsdp_version"] == 2
    # Accumulation 2 applied: 3 optimizer steps of 2 micro-batches each on every rank.
    assert report["args"]["gradient_accumulation_steps"] == 2
    assert report["global_step"] == 3 and report["forwards"] == 6
    assert len(report["losses"]) == 3 and all(loss == loss for loss in report["losses"])


def test_a_script_value_that_differs_from_the_config_is_named_once(trainer_runs):
    done, _ = trainer_runs["ddp"]
    text = done.stderr
    assert text.count("disagree on training.gradient_accumulation_steps") == 1, text[-3000:]
    block = text[text.index("disagree on training.gradient_accumulation_steps"):]
    assert "gradient_accumulation_steps=2   (cli training.gradient_accumulation_steps=2)" in block
    assert "gradient_accumulation_steps=1   (TrainingArguments(...) at" in block and "train_trainer.py:" in block
    assert "the run uses the config's gradient_accumulation_steps=2" in block
    # Not a conflict: the config leaves the learning rate at its schema default.
    assert "optim.lr" not in text


def test_script_conflicts_error_stops_the_run_with_one_report(assets):
    base, model, data = assets
    out = base / "strict"
    done = launch([str(REPO / "configs" / "ddp.yaml")],
                  ["training.gradient_accumulation_steps=2", f"output_dir={out}", "launch.script_conflicts=error"],
                  TRAINER, ["--model", str(model), "--data", str(data), "--output-dir", str(out),
                            "--gradient-accumulation-steps", "1", "--max-steps", "300"], base)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    # Every disagreement of the call at once (ddp.yaml also sets the micro-batch), reported once.
    for key in ("training.gradient_accumulation_steps", "training.micro_batch_size"):
        assert done.stderr.count(f"disagree on {key}") == 1, done.stderr[-3000:]
    assert "launch.script_conflicts is error" in done.stderr
    # The other rank either refused the same way or was still starting and was stopped first.
    assert re.search(r"also ended: rank \d \((exit 2, the same error|SIGTERM)\)", done.stderr), done.stderr[-3000:]
    assert not (out / "checkpoint-1").exists()


def test_training_arguments_from_the_config(assets):
    """The same script with `training_arguments(cfg)`: the Trainer trains with the config's values."""
    base, model, data = assets
    out = base / "from_config"
    port = free_port()
    run_yaml = base / "from_config.yaml"
    run_yaml.write_text(f"""\
parallel: {{strategy: deepspeed, deepspeed: {{zero_stage: 2}}}}
precision: {{mixed_precision: bf16}}
optim: {{lr: 0.005, weight_decay: 0.0, betas: [0.9, 0.98]}}
scheduler: {{name: linear, warmup_steps: 1}}
training: {{micro_batch_size: 3, gradient_accumulation_steps: 2, max_steps: 4, gradient_clipping: 0.5, seed: 7,
           log_every_steps: 1}}
checkpoint: {{enabled: false}}
launch: {{num_processes: 2, use_cpu: true, main_process_port: {port}}}
output_dir: {out}
""")
    done = subprocess.run([sys.executable, "-m", "overdrive.cli", "launch", "-c", str(run_yaml), str(TRAINER),
                           "--model", str(model), "--data", str(data), "--overdrive-config", str(run_yaml),
                           "--report", str(out / "report.json")],
                          capture_output=True, text=True, timeout=400, env=_env(), cwd=base)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr and "mismatch TrainingArguments" not in done.stderr
    assert "disagree" not in done.stderr  # the arguments are the config's: nothing to reconcile
    report = json.loads((out / "report.json").read_text())
    assert report["args"] == {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 3, "learning_rate": 0.005,
                              "max_steps": 4, "bf16": True, "max_grad_norm": 0.5, "seed": 7, "warmup_steps": 1,
                              "weight_decay": 0.0, "adam_beta2": 0.98, "output_dir": str(out)}
    # The Trainer's own accelerator under ZeRO-2, as test_the_trainers_accelerator_is_configured checks the others.
    assert report["distributed_type"] == "DEEPSPEED" and report["zero_stage"] == 2 and report["ds_bf16"] is True
    assert report["num_processes"] == 2 and report["mixed_precision"] == "bf16"
    assert report["ds_gradient_accumulation_steps"] == 2
    # Accumulation 2 applied: 4 optimizer steps of 2 micro-batches each on every rank.
    assert report["global_step"] == 4 and report["forwards"] == 8
    assert len(report["losses"]) == 4 and all(loss == loss for loss in report["losses"])
    # The lr each step ran at: Transformers' linear schedule, warmup over 1 step from 0 to
    # optim.lr, then linear towards 0 at max_steps.
    assert report["learning_rates"] == pytest.approx([0.0, 0.005, 0.005 * 2 / 3, 0.005 / 3])


def test_trl_sft_trainer_under_zero3(assets):
    base, model, data = assets
    out = base / "trl"
    done = launch([str(REPO / "configs" / "zero3.yaml")],
                  ["training.gradient_accumulation_steps=2", "training.micro_batch_size=2", f"output_dir={out}"],
                  TRL, ["--model", str(model), "--data", str(data), "--output-dir", str(out), "--max-steps", "2",
                        "--report", str(out / "report.json")], base)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["distributed_type"] == "DEEPSPEED" and report["zero_stage"] == 3
    assert report["num_processes"] == 2 and report["mixed_precision"] == "bf16"
    assert report["gradient_accumulation_steps"] == 2 and report["global_step"] == 2
    assert len(report["losses"]) == 2


def test_a_failing_script_is_reported_once_by_the_launcher(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text('def load():\n    raise RuntimeError("the data file is empty")\n\n\nload()\n')
    done = launch([], ["launch.num_processes=2", f"output_dir={tmp_path / 'out'}"], script, [], tmp_path)
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1 and done.stderr.count("RuntimeError: the data file is empty") == 1
    assert "overdrive: rank " in done.stderr
    # The other rank either failed the same way or was still starting and was stopped first.
    assert re.search(r"also ended: rank \d \((exit 1, the same error|SIGTERM)\)", done.stderr), done.stderr
    assert 'crash.py", line 2, in load' in done.stderr and "runpy" not in done.stderr


def test_a_direct_accelerator_call_is_settled_by_the_same_rule(tmp_path):
    script = tmp_path / "direct.py"
    script.write_text("from accelerate import Accelerator\n"
                      "accelerator = Accelerator(mixed_precision='no', gradient_accumulation_steps=1)\n"
                      "if accelerator.is_main_process:\n"
                      "    print('SETTLED', accelerator.mixed_precision, accelerator.gradient_accumulation_steps,\n"
                      "          accelerator.distributed_type.value, accelerator.num_processes)\n")
    done = launch([str(REPO / "configs" / "fsdp.yaml")], ["accum=2", f"output_dir={tmp_path / 'out'}"], script, [],
                  tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SETTLED bf16 2 FSDP 2" in done.stdout
    for key in ("precision.mixed_precision", "training.gradient_accumulation_steps"):
        assert done.stderr.count(f"disagree on {key}") == 1
    assert "(Accelerator(...) at direct.py:2)" in done.stderr
