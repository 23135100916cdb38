"""`overdrive sweep` as a user runs it, with real trials of a tiny model: killed after two
finished trials and started again as two processes on the one SQLite storage, it ends with
exactly the asked trials, none run twice, the interrupted one continued from its checkpoint.
(One run for both behaviours: each sweep costs real trials.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from overdrive.cli import main
from overdrive.resolving import resolve
from overdrive.training import metrics

pytestmark = pytest.mark.slow

TINY = {
    "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
    "tokenizer": {"vocab_size": 512},
    "data": {"max_bytes": 60_000, "max_length": 32, "validation_fraction": 0.2},
    "training": {"micro_batch_size": 8, "max_steps": 8, "eval_every_steps": 4, "eval_batches": 2, "log_every_steps": 2},
    "scheduler": {"warmup_steps": 2},
    "checkpoint": {"every_steps": 4, "save_final_model": False},
    "logging": {"trackers": ["none"], "progress": False},
    "sweep": {"trials": 4, "space": {"optim.lr": {"low": 1e-4, "high": 1e-2, "log": True},
                                     "training.micro_batch_size": [4, 8]}},
}


def write_config(tmp_path: Path, **sweep) -> Path:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["data"]["cache_dir"] = str(tmp_path / "cache")
    data["output_dir"] = str(tmp_path / "out")
    data["sweep"].update(sweep)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_sweep(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "overdrive.cli", "sweep", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=config.parent)


def load(out: Path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="out", storage=f"sqlite:///{out / 'sweep.db'}")


def last_eval_loss(output_dir: str) -> float:
    return [r for r in metrics.read(metrics.path_in(output_dir)).records if "eval_loss" in r][-1]["eval_loss"]


def check_trials(study, asked: int) -> list:
    """Exactly `asked` COMPLETE trials, each valued at the last eval loss its run wrote, in a
    directory of its own where one run wrote each step once."""
    from optuna.trial import TrialState

    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == asked, [(t.number, t.state.name, t.user_attrs) for t in study.get_trials()]
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    dirs = [t.user_attrs["output_dir"] for t in complete]
    assert len(set(dirs)) == asked
    for trial in complete:
        assert trial.value == last_eval_loss(trial.user_attrs["output_dir"])
        steps = [r["step"] for r in metrics.read(metrics.path_in(trial.user_attrs["output_dir"])).records if "loss" in r]
        assert steps == [1, 2, 4, 6, 8], (trial.number, steps)  # one run's lines, none twice
    return complete


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killed_after_two_trials_and_started_again_by_two_processes_it_finishes_the_study(tmp_path, capsys):
    from overdrive import checkpoint

    config = write_config(tmp_path, seed=7)
    out = tmp_path / "out"
    first = start_sweep(config)
    deadline = time.monotonic() + 600

    def third_trials_checkpoint():
        return checkpoint.latest_complete(checkpoint.checkpoints_dir(out / "trial-0002"), checksums=False).found

    try:
        # One process runs its trials one after another: once the third has a checkpoint to
        # continue from, two are finished. Only that file is watched, so the kill lands at once
        # (a trial is a second of training here).
        while third_trials_checkpoint() is None:
            assert first.poll() is None, first.stdout.read()
            assert time.monotonic() < deadline, "the sweep did not reach its third trial's first checkpoint"
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGKILL)  # no goodbye: the trial it ran stays RUNNING in the storage
    finally:
        first.kill()
        first.wait()
    assert sum(t.state.name == "COMPLETE" for t in load(out).get_trials()) == 2
    assert [t.number for t in load(out).get_trials() if t.state.name == "RUNNING"] == [2]
    # The interrupted trial's last checkpoint: the one seen above, or a later one written
    # before its training process followed the sweep down; read once that process is gone.
    trial_pid = next(t for t in load(out).get_trials() if t.number == 2).system_attrs["overdrive:owner"].get("trial_pid")
    while trial_pid and running(trial_pid):
        assert time.monotonic() < deadline, "the interrupted trial's training process did not end"
        time.sleep(0.05)
    saved = third_trials_checkpoint()

    # Started again as two processes on the one SQLite storage: they share what is left.
    again = [start_sweep(config) for _ in range(2)]
    said = [p.communicate(timeout=600)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], said
    study = load(out)
    complete = check_trials(study, 4)
    owners = {t.system_attrs["overdrive:owner"]["pid"] for t in complete if t.number > 2}
    print(f"trials after the restart by process: {sorted(owners)}; states {[t.state.name for t in study.get_trials()]}")
    failed = [t for t in study.get_trials() if t.state.name == "FAIL"]
    unrun = [t for t in failed if t.user_attrs.get("reason", "").startswith("not run:")]  # asked at the same moment
    assert [t.number for t in failed if t not in unrun] == [2]  # the interrupted one, run again as another trial
    retry = next(t for t in complete if t.system_attrs.get("failed_trial") == 2)
    assert retry.params == failed[0].params and retry.user_attrs["output_dir"] == str(out / "trial-0002")
    assert Path(retry.user_attrs["resumed_from"]).name == saved.path.name  # continued from its checkpoint

    best = resolve([out / "best.yaml"])  # runnable as it is, and explained to the best trial's values
    for key, value in study.best_trial.params.items():
        section, name = key.split(".")
        assert getattr(getattr(best.config, section), name) == value
        assert best.origins[key].layer == "sweep"
    trial_dir = Path(complete[0].user_attrs["output_dir"])
    origins = json.loads((trial_dir / "resolved.json").read_text())["origins"]
    assert origins["optim.lr"].startswith(f"sweep {trial_dir / 'trial.yaml'}")  # the trial's own layer
    assert (out / "report" / "history.png").is_file() and (out / "report" / "summary.md").is_file()
    assert main(["report", str(out)]) == 0
    assert f"{study.best_trial.number} *" in capsys.readouterr().out
