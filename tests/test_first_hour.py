"""What a newcomer types in the first hour, answered with their own command: hints that keep the
config, help and did-you-mean for the flags people type, variables that look like overdrive's."""

from __future__ import annotations

import shlex

from pathlib import Path
from types import SimpleNamespace

import pytest

from overdrive.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _hints(capsys, items: list[str]) -> list[str]:
    from overdrive.commands.train import _summary
    from overdrive.resolving.inputs import resolve_items

    cfg = resolve_items([*items, "output_dir=runs/x"], tell=False).config
    result = SimpleNamespace(output_dir=Path("runs/x"), first_loss=None, eval={})
    _summary(result, cfg, items)
    return [line.split("#")[0].strip() for line in capsys.readouterr().out.split("next:")[1].splitlines() if line.strip()]


def test_hints_after_a_run_keep_the_users_files_and_overrides(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("optim:\n  lr: 0.001\n")
    hints = _hints(capsys, ["run.yaml", "data.max_bytes=1000", "launch.num_processes=1", "lr=1e-3"])
    assert "overdrive explain run.yaml data.max_bytes=1000 launch.num_processes=1 lr=1e-3" in hints  # the user's lr kept
    sharded = [hint for hint in hints if "parallel.strategy=fsdp" in hint][0]
    # The user's num_processes=1 is replaced, not repeated against the suggestion.
    assert sharded.startswith("overdrive train run.yaml data.max_bytes=1000 lr=1e-3 parallel.strategy=fsdp "
                              "launch.num_processes=2")
    assert sharded.count("launch.num_processes") == 1 and "output_dir=runs/x-sharded" in sharded
    continued = [hint for hint in hints if "model.name_or_path" in hint][0]
    assert continued.startswith("overdrive train run.yaml data.max_bytes=1000") and "model.name_or_path=runs/x/model" in continued


def test_every_hint_is_accepted_by_explain_and_differs_from_the_run_just_done(capsys, tmp_path, monkeypatch):
    from overdrive import cli

    monkeypatch.chdir(tmp_path)
    # A pipeline run: ZeRO-3 (whose engine wraps the whole model) is refused with stages; an FSDP run
    # over 2 processes is not offered the same run again.
    for items in (["parallel.pp_size=2", "launch.num_processes=2", "model.architecture.tie_word_embeddings=false"],
                  ["parallel.strategy=fsdp", "launch.num_processes=2"]):
        hints = _hints(capsys, items)
        commands = [hint for hint in hints if hint.startswith(("overdrive explain", "overdrive train"))]
        assert commands
        for hint in commands:
            argv = shlex.split(hint)[1:]
            assert cli.main(["explain", *argv[1:]]) == 0, hint
            capsys.readouterr()
        assert not any("zero_stage=3" in hint for hint in hints) or "pp_size" not in " ".join(items)
        assert all(hint.split("output_dir=")[0].strip() != "overdrive train " + " ".join(items) for hint in commands)
        if "parallel.strategy=fsdp" in items:
            assert not any(hint.startswith("overdrive train") and "fsdp launch.num_processes=2 output_dir" in hint
                           for hint in hints)


def test_the_typed_items_reach_the_workers_with_secrets_masked():
    from overdrive.resolving import resolve
    from overdrive.resolving.resolved import Resolved

    resolved = resolve([], cli=["lr=1e-3"], accelerate_default=False)
    resolved.items = ["run.yaml", "lr=1e-3"]
    back = Resolved.from_json(resolved.to_json())
    assert back.items == ["run.yaml", "lr=1e-3"]
    resolved.items = ["hub.token=hf_abcdefghijklmnopqrstuvwxyz123456"]
    assert "hf_abcdef" not in resolved.to_json()


def test_help_command_prints_the_commands_help(capsys):
    code, out, _ = _run(capsys, "help", "train")
    assert code == 0 and "usage: overdrive train" in out
    assert "Resuming is automatic" in out and "KEY=VALUE" in out and "examples:" in out


@pytest.mark.parametrize("argv, expected", [
    (["trian"], "`overdrive train`"),
    (["train", "--max_steps", "20"], "training.max_steps=20"),
    (["train", "--max-steps=20"], "training.max_steps=20"),
    (["train", "training.max_steps", "20"], "training.max_steps=20"),
    (["plan", "--lr", "1e-3"], "optim.lr=1e-3"),
    (["train", "--resume"], "resuming is automatic: run the same command again"),
    (["explain", "--force"], "--force is train's"),
])
def test_what_people_type_gets_the_form_overdrive_takes(capsys, argv, expected):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and expected in err and "Traceback" not in err, err


def test_a_variable_with_one_underscore_is_named_with_its_right_spelling():
    from overdrive.resolving import resolve

    resolved = resolve([], env={"OVERDRIVE_TRAINING_MAX_STEPS": "5", "OVERDRIVE_DEBUG": "1"}, accelerate_default=False)
    assert resolved.config.training.max_steps != 5
    rendered = [problem.render() for problem in resolved.warnings]
    assert any("OVERDRIVE_TRAINING_MAX_STEPS is not read" in text and "OVERDRIVE_TRAINING__MAX_STEPS=5" in text
               for text in rendered), rendered
    assert not any("OVERDRIVE_DEBUG" in text for text in rendered)


def _stale_accelerate_default(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 3\nmixed_precision: 'no'\n")
    monkeypatch.setenv("HF_HOME", str(home))


def test_train_takes_the_flag_its_warning_offers(capsys, tmp_path, monkeypatch):
    _stale_accelerate_default(tmp_path, monkeypatch)
    code, out, err = _run(capsys, "train", "--print-launch")
    assert code == 0 and "--no-accelerate-default" in err and "--nproc-per-node 3" in out
    code, out, err = _run(capsys, "train", "--print-launch", "--no-accelerate-default")
    assert code == 0 and "default_config.yaml" not in err and "--nproc-per-node 1" in out


def test_plan_takes_the_flag_and_resolves_without_the_default(capsys, tmp_path, monkeypatch):
    _stale_accelerate_default(tmp_path, monkeypatch)
    import overdrive.resolving.inputs as inputs

    from overdrive.errors import UserError

    seen = {}

    def resolve_items(items, accelerate_default=True, **_):
        seen["accelerate_default"] = accelerate_default
        raise UserError("resolved no further here")

    monkeypatch.setattr(inputs, "resolve_items", resolve_items)
    code, _, err = _run(capsys, "plan", "--no-accelerate-default", "training.max_steps=20")
    assert code == 2 and "resolved no further here" in err and seen == {"accelerate_default": False}


def test_every_config_overdrive_writes_has_an_output_dir_of_its_own(capsys, tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "config", "--non-interactive", "-o", "mine.yaml", "--num-processes", "1",
                        "--machine-type", "cpu")
    assert code == 0, err
    assert yaml.safe_load(Path("mine.yaml").read_text())["output_dir"] == "runs/mine"
    Path("zero2.json").write_text('{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}')
    code, out, err = _run(capsys, "import", "zero2.json")
    assert code == 0, err
    assert yaml.safe_load(out)["output_dir"] == "runs/zero2"
    code, out, err = _run(capsys, "import", "zero2.json", "-o", "imported.yaml")
    assert code == 0 and yaml.safe_load(Path("imported.yaml").read_text())["output_dir"] == "runs/imported"


def test_the_wizard_says_its_file_exists_before_any_question(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("overdrive.yaml").write_text("training: {max_steps: 5}\n")
    prompts = []

    def answer(prompt=""):
        prompts.append(prompt)
        return "n" if len(prompts) == 1 else ""

    monkeypatch.setattr("builtins.input", answer)
    code, out, err = _run(capsys, "config")
    assert code == 1 and "exists" in prompts[0] and len(prompts) == 2, prompts
    assert Path("overdrive.yaml").read_text() == "training: {max_steps: 5}\n"


def test_a_short_run_from_a_file_gets_a_warmup_that_fits_and_no_warning(tmp_path):
    from overdrive.resolving import resolve

    run = tmp_path / "run.yaml"
    run.write_text("training:\n  max_steps: 20\n")
    resolved = resolve([run], accelerate_default=False, env={})
    assert resolved.warnings == [] and resolved.config.scheduler.warmup_steps == 2
    assert resolved.origins["scheduler.warmup_steps"].layer == "derived"
    # A long run keeps the default; a warmup the user set is theirs, and still told.
    assert resolve([], accelerate_default=False, env={}).config.scheduler.warmup_steps == 40
    told = resolve([run], cli=["scheduler.warmup_steps=40"], accelerate_default=False, env={})
    assert [p.key for p in told.warnings] == ["scheduler.warmup_steps"]


def test_a_default_the_users_choice_contradicts_follows_it_with_its_origin():
    from overdrive.errors import UserError
    from overdrive.resolving import resolve

    resolved = resolve([], cli=["optim.name=schedule_free_adamw"], accelerate_default=False, env={})
    assert resolved.config.scheduler.name == "constant"
    assert "schedule_free_adamw" in str(resolved.origins["scheduler.name"])
    with pytest.raises(UserError, match="scheduler.name"):
        resolve([], cli=["optim.name=schedule_free_adamw", "scheduler.name=cosine"], accelerate_default=False, env={})


@pytest.mark.slow
def test_plan_refuses_chat_data_that_train_refuses(capsys, tmp_path):
    from hf_fixtures import make_tiny_llama

    model = make_tiny_llama(tmp_path / "llama")
    data = tmp_path / "chat.jsonl"
    data.write_text('{"text": "hello there"}\n{"text": "more"}\n')
    code, out, err = _run(capsys, "plan", "data.format=chat", f"data.source={data}", f"model.name_or_path={model}",
                          "training.max_steps=20", "data.max_length=128", "--no-accelerate-default")  # its positions
    assert code == 2 and "data.messages_column" in err, (out, err)


@pytest.mark.parametrize("name", ["./models/base", "~/no-such-model-here", "/no/such/model"])
def test_a_missing_local_model_path_is_called_missing_before_any_hub_lookup(capsys, tmp_path, monkeypatch, name):
    import overdrive.hub as hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "unreachable", lambda: pytest.fail("the hub was asked about a local path"))
    code, out, err = _run(capsys, "plan", f"model.name_or_path={name}", "--no-accelerate-default")
    assert code == 2 and f"{name} does not exist" in err and "hf download" not in err, err


def test_a_name_under_an_existing_directory_is_local(tmp_path, monkeypatch):
    from overdrive.hub import looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_local("models/base") and not looks_local("gpt2") and not looks_local("openai-community/gpt2")


def test_report_writes_only_data_on_stdout_and_reads_the_run_of_its_metrics_file(capsys, tmp_path):
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10, "lr": 1e-3,
                                                           "tokens_per_s": 100.0}) + "\n" for s in (1, 2, 3)))
    code, out, err = _run(capsys, "report", str(run / "metrics.jsonl"))
    assert code == 0, err
    assert "wrote" in err and "wrote" not in out.lower() and "loss" in out


def test_docs_says_what_it_wrote_on_stderr(capsys, tmp_path):
    code, out, err = _run(capsys, "docs", "-o", str(tmp_path / "config.md"))
    assert code == 0 and out == "" and "wrote" in err


@pytest.mark.parametrize("command", ["k8s", "skypilot"])
def test_cluster_writers_take_o_and_keep_an_existing_file(capsys, tmp_path, command):
    target = tmp_path / "job.yaml"
    code, out, err = _run(capsys, command, "--no-accelerate-default", "launch.image=example/overdrive:1",
                          "launch.accelerator=A100", "-o", str(target))
    assert code == 0 and out == "" and f"wrote {target}" in err and target.read_text().strip(), err
    target.write_text("mine\n")
    code, out, err = _run(capsys, command, "--no-accelerate-default", "launch.image=example/overdrive:1",
                          "launch.accelerator=A100", "-o", str(target))
    assert code == 2 and "--force" in err and target.read_text() == "mine\n"


@pytest.mark.slow
def test_launch_print_env_writes_nothing_and_passes_on_no_port_warning(capsys, tmp_path, monkeypatch):
    import socket

    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('hello')\n")
    with socket.socket() as busy:  # the configured port in use: Accelerate's own probe would warn
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = _run(capsys, "launch", "--no-accelerate-default", "-s", "parallel.strategy=deepspeed",
                              "-s", "launch.num_processes=2", "-s", f"launch.main_process_port={port}",
                              "--print-env", "train.py")
    assert code == 0 and "ACCELERATE_DEEPSPEED_CONFIG_FILE=" in out, err
    assert "already in use" not in err and "Warning" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_an_unknown_model_type_gets_close_names_not_the_whole_list(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt3", "n_layer": 2}')
    code, out, err = _run(capsys, "estimate", str(tmp_path))
    assert code == 2 and "unknown model_type 'gpt3'" in err and "gpt2" in err
    assert len(err) < 600 and "altclip" not in err, err


def test_counts_and_parameters_read_right():
    from overdrive.console import counted
    from overdrive.memory.report import parameter_count

    assert [counted(1, "process"), counted(2, "process"), counted(1, "device"), counted(8, "GPU")] == \
        ["1 process", "2 processes", "1 device", "8 GPUs"]
    assert [parameter_count(1_190_000), parameter_count(124_000_000), parameter_count(6.74e9)] == ["1.19M", "124M", "6.74B"]


def test_a_run_keeps_what_the_user_typed_for_its_hints(tmp_path):
    import argparse

    from overdrive.commands.arguments import load_run

    run = tmp_path / "run.yaml"
    run.write_text("training:\n  max_steps: 20\n")
    resolved, in_worker = load_run(argparse.Namespace(items=[str(run), "lr=1e-3"], resolved=None,
                                                      no_accelerate_default=True))
    assert not in_worker and resolved.items == [str(run), "lr=1e-3", "--no-accelerate-default"]
