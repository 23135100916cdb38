"""What a run says is true when it is said: a checkpoint path printed once the checkpoint is complete
(checkpoint.async writes it in the background), one stop line per Ctrl-C."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from overdrive.training.loop import Loop, Outcome


def _loop(in_background: bool, said: list[str]) -> Loop:
    loop = object.__new__(Loop)
    recipe = SimpleNamespace(positions=lambda state: {}, eval_mode=lambda: None, train_mode=lambda: None)
    loop.parts = SimpleNamespace(recipe=recipe, accelerator=None, objective=SimpleNamespace(pending=lambda: None))
    loop.state = SimpleNamespace(step=4)
    loop.guard = SimpleNamespace(run_length=lambda: 0)
    loop.loss_tokens = SimpleNamespace(total=lambda acc: 0)
    loop.ckpt = SimpleNamespace(in_background=in_background, save=lambda state: Path("/runs/x/checkpoints/step-4"))
    loop.progress = SimpleNamespace(print=said.append)
    loop.outcome = Outcome()
    return loop


@pytest.mark.parametrize("in_background", [False, True])
def test_a_checkpoint_path_is_said_only_once_it_is_written(in_background):
    said: list[str] = []
    _loop(in_background, said).save()
    # A background save says its path when it is complete (Checkpointer.wait), not when it is staged.
    assert said == ([] if in_background else ["checkpoint: /runs/x/checkpoints/step-4"])


def test_the_step_a_stop_signal_names_is_the_one_the_ranks_stop_after():
    """A signal after a step's end and before the ranks agree stops after that step, not the next
    (a two-process Ctrl-C said "after step 11" and stopped after step 10)."""
    loop = object.__new__(Loop)
    loop.state = SimpleNamespace(step=10)
    loop.step_done = True
    assert loop.stop_step() == 10
    loop.step_done = False  # in step 11, or past the agreement: counted at step 11's
    assert loop.stop_step() == 11


def test_a_worker_under_a_launcher_leaves_the_resume_line_to_the_launcher(monkeypatch, capsys):
    from overdrive.commands import train as train_command
    from overdrive.config.schema import RunConfig

    stopped = SimpleNamespace(stopped_by=2, is_main_process=True, checkpoint=Path("/runs/x/checkpoints/step-4"))
    monkeypatch.setattr("overdrive.training.loop.train", lambda resolved, force=False: stopped)
    for processes, lines in ((2, 0), (1, 1)):
        resolved = SimpleNamespace(config=RunConfig.model_validate({"launch": {"num_processes": processes}}))
        assert train_command._train_here(resolved, False, in_worker=True) == 130
        said = capsys.readouterr().err
        assert said.count("stopped by SIGINT") == lines, said
