"""overdrive.hf.training_arguments, the Trainer-owned "auto" entries of a script's DeepSpeed
config, the rule that settles a script's own TrainingArguments / Accelerator values under
`overdrive launch`, its scoping, and the launcher's one report of a failed worker."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import run_cli
from strategy_probe import REPO

from overdrive import load_config
from overdrive.resolving import resolve
from overdrive.errors import UserError

CPU = ["launch.use_cpu=true"]


def test_training_arguments_take_every_value_from_the_config():
    from overdrive.hf import training_arguments

    cfg = load_config(cli=CPU + ["optim.lr=5e-3", "accum=3", "training.micro_batch_size=4", "training.max_steps=9",
                                 "training.gradient_clipping=0.5", "scheduler.name=linear", "scheduler.warmup_steps=2",
                                 "training.seed=5", "optim.betas=[0.8,0.9]", "output_dir=/tmp/od-hf"])
    args = training_arguments(cfg, report_to="none")
    assert (args.learning_rate, args.gradient_accumulation_steps, args.per_device_train_batch_size) == (5e-3, 3, 4)
    assert (args.max_steps, args.max_grad_norm, args.warmup_steps, args.seed) == (9, 0.5, 2, 5)
    assert (args.adam_beta1, args.adam_beta2, args.output_dir) == (0.8, 0.9, "/tmp/od-hf")
    assert args.lr_scheduler_type.value == "linear" and args.use_cpu and args.report_to == []
    assert args.deepspeed is None and not args.fsdp


def test_the_fsdp_fields_say_fsdp2():
    from overdrive.hf import training_arguments_kwargs

    kwargs = training_arguments_kwargs(load_config(str(REPO / "configs" / "fsdp.yaml")))
    assert kwargs["fsdp"] == "full_shard auto_wrap"
    assert kwargs["fsdp_config"]["version"] == 2 and kwargs["fsdp_config"]["reshard_after_forward"] is True


def test_the_trainer_fills_a_scripts_deepspeed_config_without_a_mismatch():
    """What the Trainer owns is "auto", so Transformers' own processing fills it from the
    TrainingArguments, which hold the configured values, and finds nothing to refuse."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from overdrive.hf import training_arguments
    from overdrive.interop.writing import TRAINER_OWNED, deepspeed_json

    cfg = load_config(str(REPO / "configs" / "zero2.yaml"), cli=CPU + ["accum=2", "training.gradient_clipping=0.7"])
    config = deepspeed_json(cfg, trainer_owned_auto=True)
    for path in TRAINER_OWNED:
        node = config
        for part in path.split("."):
            node = node[part]
        assert node == "auto", path
    args = training_arguments(cfg.model_copy(update={"parallel": load_config().parallel}), report_to="none")
    hf = HfTrainerDeepSpeedConfig(config)
    hf.trainer_config_process(args)
    assert hf.mismatches == []
    filled = hf.config
    assert filled["gradient_accumulation_steps"] == 2 and filled["gradient_clipping"] == 0.7
    assert filled["bf16"]["enabled"] is True and filled["train_micro_batch_size_per_gpu"] == 16


def _settled(overrides, script_conflicts="warn", **script_kwargs):
    from transformers import TrainingArguments

    from overdrive.launch import script_values

    resolved = resolve([], cli=CPU + overrides + [f"launch.script_conflicts={script_conflicts}"])
    with script_values.applied(resolved.config, resolved.origins, __file__):
        return TrainingArguments(output_dir="/tmp/od-hf-script", report_to="none", use_cpu=True, **script_kwargs)


def test_the_config_wins_where_it_sets_a_key_and_the_conflict_is_named(capsys):
    args = _settled(["accum=2"], gradient_accumulation_steps=1, learning_rate=1e-4)
    err = capsys.readouterr().err
    assert args.gradient_accumulation_steps == 2
    assert "disagree on training.gradient_accumulation_steps" in err and "cli accum=2" in err
    assert f"TrainingArguments(...) at {__file__.split('/')[-1]}" in err or "test_hf.py:" in err
    # optim.lr is the schema default: the script's value stands, silently.
    assert args.learning_rate == 1e-4 and "optim.lr" not in err


def test_a_key_the_script_leaves_alone_takes_the_config_value_silently(capsys):
    args = _settled(["accum=4", "optim.lr=3e-3"])
    assert (args.gradient_accumulation_steps, args.learning_rate) == (4, 3e-3)
    assert "disagree" not in capsys.readouterr().err


def test_script_conflicts_error_refuses():
    with pytest.raises(UserError, match="launch.script_conflicts"):
        _settled(["accum=2"], script_conflicts="error", gradient_accumulation_steps=1)


def test_the_patches_are_undone_after_the_script(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from transformers import TrainingArguments

    import transformers.training_args as training_args
    from overdrive.launch import script_values
    from overdrive.strategies import cpu

    @dataclasses.dataclass
    class Subclass(TrainingArguments):  # as TRL's configs are
        extra: int = 1

    before = (Accelerator.__init__, TrainingArguments.__post_init__, PartialState.__init__,
              training_args.is_torch_bf16_gpu_available)
    resolved = resolve([str(REPO / "configs" / "zero3.yaml")], cli=CPU)
    for _ in range(2):
        with script_values.applied(resolved.config, resolved.origins, __file__), \
                cpu.apply_to_user_accelerators(resolved.config):
            assert Accelerator.__init__ is not before[0] and PartialState.__init__ is not before[2]
            assert TrainingArguments.__post_init__ is not before[1]
        assert (Accelerator.__init__, TrainingArguments.__post_init__, PartialState.__init__,
                training_args.is_torch_bf16_gpu_available) == before
        # Built after the block, with arguments, the class and its subclasses are as they were.
        built = Subclass(output_dir=str(tmp_path), report_to="none", use_cpu=True, extra=3)
        assert built.extra == 3 and script_values.CALL_RECORD not in vars(built)


@pytest.mark.slow
def test_overdrive_options_after_the_script_are_the_scripts_and_a_warning_says_so(tmp_path):
    from overdrive.commands.launch import misplaced_options

    assert misplaced_options(["-c", "run.yaml", "--epochs", "3", "lr=3e-4", "name=x"]) == ["-c", "lr=3e-4"]
    script = tmp_path / "s.py"
    script.write_text("")
    done = run_cli("launch", "--print-env", str(script), "-c", "run.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning: the script's arguments include -c" in done.stderr and "its defaults" in done.stderr


def test_a_failed_worker_is_reported_once_with_the_root_cause(tmp_path):
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from overdrive.launch.elastic import describe, exit_code

    def error_file(name, message, stack):
        path = tmp_path / name
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": stack,
                                                                                  "timestamp": "1"}}}))
        return str(path)

    stack = "Traceback (most recent call last):\n" + "".join(f'  File "x.py", line {i}\n' for i in range(30)) + \
        "ValueError: the root cause"
    error = ChildFailedError("overdrive.cli", {
        0: ProcessFailure(0, 10, 1, error_file("0.json", "ValueError: the root cause", stack)),
        1: ProcessFailure(1, 11, 1, error_file("1.json", "ValueError: the root cause", stack)),
        2: ProcessFailure(2, 12, -signal.SIGTERM, "<N/A>")})
    text = describe(error)
    assert text.count("ValueError: the root cause") == 1 and "line 29" in text and "line 3\n" not in text
    assert "rank 1 (exit 1, the same error)" in text and "rank 2 (SIGTERM)" in text
    assert exit_code(error) == 1


@pytest.mark.slow
def test_explain_lists_the_training_arguments_with_their_keys():
    done = run_cli("explain", str(REPO / "configs" / "zero2.yaml"), "accum=2", "--training-arguments", "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["field"]: row for row in json.loads(done.stdout)}
    assert rows["gradient_accumulation_steps"]["value"] == 2 and rows["gradient_accumulation_steps"]["origin"] == "cli accum=2"
    assert rows["bf16"]["key"] == "precision.mixed_precision" and "zero2.yaml:" in rows["bf16"]["origin"]
    assert rows["deepspeed"]["value"]["gradient_accumulation_steps"] == "auto"
