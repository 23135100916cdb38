"""`overdrive config`: typed into a real terminal, flags for scripts, and the files it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from overdrive.wizard import questions as wizard

from overdrive.wizard import files as wizard_files
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError

BIN = Path(sys.executable).parent / "overdrive"
OVERDRIVE = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "overdrive.cli"]
CPU_BOX = {"gpus": [], "cpu_logical_cores": 2, "cpu_bf16_native": False, "ram_bytes": 8 * 2**30}
# What the trainer needs to finish in seconds on two cores.
TOY = ["training.max_steps=3", "model.architecture.n_layer=1", "model.architecture.n_embd=32",
       "model.architecture.n_head=2", "data.max_length=32", "training.micro_batch_size=2",
       "data.max_bytes=200000", "tokenizer.vocab_size=512", "scheduler.warmup_steps=1",
       "training.eval_batches=1", "checkpoint.save_final_model=false", "logging.trackers=[none]"]


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No Accelerate default config, no ACCELERATE_* or OVERDRIVE_* leaking in from the shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "OVERDRIVE_", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), COLUMNS="120")
    return env


def scripted(answers: list[str], preset=None) -> tuple[wizard.Answers, list[str]]:
    said: list[str] = []
    feed = iter(answers)
    ask = wizard.Asker(preset=preset or {}, read=lambda prompt: next(feed), say=said.append)
    return wizard.ask_all(ask, CPU_BOX), said


def test_parsers_reject_bad_answers_with_a_reason():
    with pytest.raises(ValueError, match="not one of: 0, 1, 2, 3"):
        wizard.choice(("0", "1", "2", "3"))("5")
    with pytest.raises(ValueError, match="not one of"):
        wizard.choice(("0", "1", "2", "3"))("4")  # digits are the options, not their positions
    assert wizard.choice(("ddp", "deepspeed", "fsdp"))("fs") == "fsdp"
    assert wizard.choice(("ddp", "deepspeed", "fsdp"))("2") == "deepspeed"
    with pytest.raises(ValueError, match="not one of"):
        wizard.choice(("ddp", "deepspeed", "fsdp"))("d")  # ambiguous prefix
    with pytest.raises(ValueError, match="not a whole number"):
        wizard.integer(1)("two")
    with pytest.raises(ValueError, match="at least 1"):
        wizard.integer(1)("0")
    with pytest.raises(ValueError, match="yes or no"):
        wizard.yes_no("maybe")


def test_bad_answers_are_asked_again():
    answers = ["", "cpu", "two", "2", "", "fp16", "no", "deepspeed", "5", "3", "cpu", "none", "n", "4"]
    a, said = scripted(answers)
    assert (a.num_processes, a.mixed_precision, a.strategy, a.zero_stage) == (2, "no", "deepspeed", 3)
    assert (a.offload_optimizer, a.offload_param, a.accum, a.model) == ("cpu", "none", 4, None)
    assert any("'two' is not a whole number" in s for s in said)
    assert any("fp16 needs a GPU" in s for s in said)
    assert any("'5' is not one of" in s for s in said)


def test_multi_machine_processes_split_evenly():
    answers = ["multi", "gpu", "2", "1", "10.0.0.1", "", "3", "4", "", "", "ddp", "yes", "aot_eager", ""]
    a, said = scripted(answers)
    assert (a.num_machines, a.machine_rank, a.main_process_ip, a.num_processes) == (2, 1, "10.0.0.1", 4)
    assert any("do not split evenly" in s for s in said)
    assert a.compile_backend == "aot_eager" and a.mixed_precision == "bf16"
    launch = wizard_files.run_config(a)["launch"]
    assert launch == {"num_processes": 4, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
                      "main_process_port": 29500}


def test_closed_stdin_is_a_user_error():
    ask = wizard.Asker(read=lambda prompt: (_ for _ in ()).throw(EOFError))
    with pytest.raises(UserError, match="--non-interactive"):
        wizard.ask_all(ask, CPU_BOX)


def tiny_model(tmp_path: Path) -> Path:
    """A local model directory (config only): the estimator reads it without the network."""
    model = tmp_path / "tiny-gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 2,
        "n_positions": 256, "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0}))
    return model


def test_memory_estimate_suggests_a_strategy(tmp_path):
    if importlib.util.find_spec("overdrive.memory.model_shape") is None:
        pytest.skip("the memory estimator is not available")
    model = str(tiny_model(tmp_path))
    said: list[str] = []
    a = wizard.Answers(model=model, num_processes=2, mixed_precision="no")
    tip = wizard.memory_suggestion(a, CPU_BOX, said.append)
    assert tip["strategy"] == "ddp" and "cheapest strategy that fits" in tip["why"]
    # Nothing fits a 1 MiB GPU: no suggestion, and the note says why.
    gpu = {"gpus": [{"memory_bytes": 2**20, "name": "tiny", "bf16": True}], "ram_bytes": 2**20}
    a = wizard.Answers(model=model, num_processes=1, machine_type="gpu", mixed_precision="bf16")
    assert wizard.memory_suggestion(a, gpu, said.append) is None and "no strategy fits" in a.notes[-1]
    # An unreadable model is a note, not an error.
    a = wizard.Answers(model=str(tmp_path / "missing" / "config.json"), num_processes=1)
    assert wizard.memory_suggestion(a, CPU_BOX, said.append) is None and "no memory estimate" in a.notes[-1]


@pytest.mark.slow
def test_non_interactive_flags_write_the_nested_schema(tmp_path):
    out = tmp_path / "ds.yaml"
    model = str(tiny_model(tmp_path))
    flags = ["--non-interactive", "-o", str(out), "--strategy", "deepspeed", "--zero-stage", "3",
             "--offload-optimizer", "cpu", "--mixed-precision", "bf16", "--accum", "4", "--num-processes", "2",
             "--compile", "--model", model, "--accelerate-default"]
    result = subprocess.run(OVERDRIVE + ["config", *flags], env=clean_env(tmp_path), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("# overdrive run config") and "# Keep optimizer states on cpu or nvme" in text
    data = yaml.safe_load(text)
    assert data == {
        "output_dir": "runs/ds",
        "model": {"name_or_path": model},
        "precision": {"mixed_precision": "bf16"},
        "training": {"gradient_accumulation_steps": 4},
        "parallel": {"strategy": "deepspeed",
                     "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "none"}},
        "compile": {"backend": "inductor"},
        "launch": {"num_processes": 2, "num_machines": 1, "use_cpu": True},
    }
    RunConfig.model_validate(data)

    from accelerate.commands.config.config_args import load_config_from_file

    acc_path = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    acc = load_config_from_file(str(acc_path))
    assert acc.distributed_type.value == "DEEPSPEED" and acc.mixed_precision == "bf16" and acc.num_processes == 2
    assert acc.deepspeed_config["zero_stage"] == 3 and acc.deepspeed_config["offload_optimizer_device"] == "cpu"
    assert acc.deepspeed_config["gradient_accumulation_steps"] == 4
    assert acc.dynamo_config["dynamo_backend"] == "INDUCTOR"

    # Never overwrite without --force; say which file and how.
    before = out.read_text()
    again = subprocess.run(OVERDRIVE + ["config", "--non-interactive", "-o", str(out), "--strategy", "fsdp"],
                           env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and str(out) in again.stderr and "--force" in again.stderr
    assert out.read_text() == before


@pytest.mark.slow
def test_bad_flag_is_rejected_with_the_same_message(tmp_path):
    result = subprocess.run(OVERDRIVE + ["config", "--non-interactive", "-o", str(tmp_path / "x.yaml"),
                                         "--strategy", "deepspeed", "--zero-stage", "5"],
                            env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--zero-stage: '5' is not one of: 0, 1, 2, 3" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x.yaml").exists()


def test_fsdp_accelerate_default_is_fsdp2(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    a = wizard.Answers(strategy="fsdp", reshard_after_forward=False, num_processes=2, machine_type="gpu",
                       mixed_precision="bf16")
    path = tmp_path / "default_config.yaml"
    wizard_files.write_accelerate_default(a, path)
    acc = load_config_from_file(str(path))
    assert acc.distributed_type.value == "FSDP"
    assert acc.fsdp_config["fsdp_version"] == 2 and acc.fsdp_config["fsdp_reshard_after_forward"] is False
    assert wizard_files.run_config(a)["parallel"] == {"strategy": "fsdp",
                                                "fsdp": {"reshard_after_forward": False, "offload_params": False}}


@pytest.mark.slow
def test_wizard_in_a_real_terminal_then_explain_and_train(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    out = tmp_path / "run.yaml"
    out.write_text("# an older config\n")
    env = clean_env(tmp_path)
    child = pexpect.spawn(OVERDRIVE[0], OVERDRIVE[1:] + ["config", "-o", str(out)], env=env, encoding="utf-8",
                          timeout=60, dimensions=(40, 140))
    transcript = []
    child.logfile_read = type("Log", (), {"write": lambda self, s: transcript.append(s), "flush": lambda self: None})()

    def answer(prompt: str, text: str) -> None:
        child.expect(prompt)
        child.sendline(text)

    answer("Overwrite", "y")  # said before the first question, not after them all
    answer("Where will this run", "")
    answer("Which kind of machine", "cpu")
    answer("How many processes", "two")
    child.expect("not a whole number")
    answer("How many processes", "1")
    answer("Model to train", "")
    answer("Mixed precision", "fp8")
    child.expect("needs a GPU")
    answer("Mixed precision", "no")
    answer("Parallelism strategy", "deepspeed")
    answer("ZeRO stage", "5")
    child.expect("not one of: 0, 1, 2, 3")
    answer("ZeRO stage", "2")
    answer("Offload optimizer", "none")
    answer("Use torch.compile", "no")
    answer("accumulation steps", "2")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, "".join(transcript)

    data = yaml.safe_load(out.read_text())
    assert data["parallel"] == {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_optimizer": "none"}}
    assert data["training"] == {"gradient_accumulation_steps": 2}
    assert data["precision"] == {"mixed_precision": "no"}
    assert data["launch"] == {"num_processes": 1, "num_machines": 1, "use_cpu": True}
    assert data["output_dir"] == "runs/run"

    if importlib.util.find_spec("overdrive.commands.explain") is None:
        pytest.skip("overdrive explain is not available yet")
    explain = subprocess.run(OVERDRIVE + ["explain", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert explain.returncode == 0, explain.stdout + explain.stderr

    if importlib.util.find_spec("overdrive.training.loop") is None:
        pytest.skip("overdrive train is not available yet")
    run_dir = tmp_path / "run"
    train = subprocess.run(
        OVERDRIVE + ["train", str(out), *TOY, f"output_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").is_file()
    report = subprocess.run(OVERDRIVE + ["report", str(run_dir)], env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "deepspeed ZeRO-2" in (run_dir / "report" / "summary.md").read_text()


def test_required_answers_and_unused_flags(tmp_path):
    with pytest.raises(UserError, match="--main-process-ip: required"):
        wizard.ask_all(wizard.Asker(preset={"num_machines": "2", "where": "multi"}, interactive=False), CPU_BOX)
    ask = wizard.Asker(preset={"zero_stage": "3"}, interactive=False)
    a = wizard.ask_all(ask, CPU_BOX)
    assert a.strategy == "ddp" and ask.unused_flags() == ["--zero-stage"]
    # Enter on a question without a default asks again instead of leaving it empty.
    a, said = scripted(["multi", "cpu", "2", "0", "", "node0", "", "", "", "", "", "", ""])
    assert a.main_process_ip == "node0" and any("required" in s for s in said)
