"""A refusal's fix can be followed: every `fix:` (or offered) line that is a command is run as
written (placeholders filled in) and does what it says, rather than meeting another refusal."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from conftest import run_cli

QUICK = ["training.max_steps=2", "launch.use_cpu=true", "logging.trackers=[none]", "logging.progress=false",
         "precision.mixed_precision=no", "data.validation_fraction=0"]


def offered_commands(text: str) -> list[list[str]]:
    """The `overdrive ...` commands a message offers (after `fix:`, or a line's colon), as arguments."""
    found = []
    for line in text.splitlines():
        at = line.find("overdrive train ")
        if at >= 0 and ("fix:" in line or "to train further" in line):
            found.append(shlex.split(line[at:].split(";")[0])[1:])
    return found


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    done = run_cli("train", f"output_dir={out}", *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_finished_runs_train_further_command_trains_further(finished):
    again = run_cli("train", f"output_dir={finished}", *QUICK)
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "raise training.max_steps to train further" in said, said[-2000:]
    [command] = offered_commands(said)
    further = run_cli(*command)
    assert further.returncode == 0, further.stdout[-2000:] + further.stderr[-3000:]
    assert "step 4/4" in further.stdout + further.stderr
    assert (finished / "checkpoints" / "step-00000004").is_dir()
    assert (finished / "checkpoints" / "step-00000002").is_dir()  # the finished run's checkpoint is kept


@pytest.mark.slow
def test_another_model_in_a_finished_runs_directory_offers_a_new_directory_not_force(finished):
    items = ["train", f"output_dir={finished}", *QUICK, "model.architecture.n_layer=2"]
    refused = run_cli(*items)
    said = refused.stderr
    assert refused.returncode == 2 and "--force" not in said and len(said.splitlines()) < 10, said
    [command] = offered_commands(said.replace("fix: train in a new output_dir: output_dir=",
                                              "fix: overdrive train " + shlex.join(items[1:]) + " output_dir="))
    for forced in (items + ["--force"],):  # --force is no way out either: one short message, no key names
        tried = run_cli(*forced)
        assert tried.returncode == 2 and len(tried.stderr.splitlines()) < 10, tried.stderr
        assert "transformer.h" not in tried.stderr
    follow = run_cli(*command)
    assert follow.returncode == 0, follow.stderr[-3000:]
