"""The sweep loop: ask Optuna for a trial, train it, tell Optuna, until the study has
`sweep.trials` finished trials (counted over every process sharing it).

Each trial resolves the sweep's own config sources with its values above them (a `sweep`
layer, trial_layer.py), in `<output_dir>/trial-NNNN` (a trial run again after an
interruption keeps its first directory and continues from its checkpoint there).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from overdrive.config.sweep_space import SpaceEntry
from overdrive.errors import Problem, UserError
from overdrive.storage.lock import exclusive
from overdrive.sweep import study as studies
from overdrive.sweep import trial_layer
from overdrive.sweep.execute import Execution, execute

FAILURES_IN_A_ROW = 3  # trials this process ran that failed one after another: the sweep stops
CLAIM_LOCK = ".sweep-claims"  # in the sweep's output_dir
WAIT_S = 1.0  # between looks at the storage while other processes run the last trials


@dataclass
class Job:
    resolved: Any  # config.Resolved: the sweep's config, with the `sweep` section
    entries: list[SpaceEntry]
    files: list[str] = field(default_factory=list)
    cli: list[str] = field(default_factory=list)
    accelerate_default: bool = True
    runner: str = "fork"

    @property
    def config(self):
        return self.resolved.config

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir).expanduser().resolve()


@dataclass
class Finish:
    tally: studies.Tally
    ran: list[int]  # trial numbers this process ran
    stopped_by: int = 0  # the signal that stopped the sweep
    failed: str = ""  # why the sweep gave up


class _Signals:
    """SIGTERM/SIGINT: the running trial checkpoints and is queued again; the sweep stops."""

    def __init__(self):
        self.received = 0

    def __enter__(self):
        self.saved = {s: signal.signal(s, self._on) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _on(self, signum, _frame) -> None:
        self.received = signum

    def __exit__(self, *_):
        for s, handler in self.saved.items():
            signal.signal(s, handler)


def check_output_dir(job: Job, study) -> None:
    """A new study in a directory holding another study's trial directories would resume
    their checkpoints as its own trials: refused, nothing touched."""
    if study.get_trials(deepcopy=False):
        return
    old = sorted(p.name for p in job.output_dir.glob("trial-*") if p.is_dir())
    if old:
        raise UserError(Problem("output_dir", f"{job.output_dir} holds trial directories ({', '.join(old[:3])}"
                                f"{', ...' if len(old) > 3 else ''}) but study {studies.study_name(job.config)!r} in "
                                f"{studies.storage_url_shown(job.config)} has no trials",
                                fix="continue the study they belong to (its sweep.storage and sweep.study_name), "
                                "or use a fresh output_dir"))


def prepare_data(job: Job, starter, root: Path) -> None:
    """Tokenizer and token cache once, before the first trial (a no-op when they are cached)."""
    from overdrive.tune import trials

    prepared = trials.prepare(job.resolved.to_json(), root / "prepare", starter)
    if prepared.status != "ok":
        raise UserError(Problem("data.source", f"the data could not be prepared: {prepared.reason}",
                                fix="run `overdrive train` with the same config to see the whole error"))


def run(job: Job, study, show: Callable[[Any], None] = lambda study: None) -> Finish:
    """Run trials until the study has `sweep.trials` finished ones (or a signal, or failures)."""
    from overdrive.tune import starter_for

    target = job.config.sweep.trials
    root = Path(tempfile.mkdtemp(prefix=".sweep-", dir=job.output_dir))
    starter = starter_for(job.config, job.runner, root)
    ran: list[int] = []
    failures = 0
    try:
        with _Signals() as signals:
            if studies.tally(study).finished < target:
                prepare_data(job, starter, root)
            while not signals.received:
                now, trial = _take_trial(job, study, target)
                show(study)
                if now.finished >= target:
                    return Finish(now, ran)
                if trial is None:  # others run the last ones: wait, in case one fails
                    time.sleep(WAIT_S)
                    continue
                ran.append(trial.number)
                outcome = run_trial(job, study, trial, starter, signals, show)
                failures = failures + 1 if outcome.status == "failed" else 0
                if failures >= FAILURES_IN_A_ROW:
                    return Finish(studies.tally(study), ran, failed=f"{failures} trials in a row failed; the last, trial "
                                  f"{trial.number}: {outcome.reason} (log: {outcome.log})")
            return Finish(studies.tally(study), ran, stopped_by=signals.received)
    finally:
        starter.close()
        shutil.rmtree(root, ignore_errors=True)


def _take_trial(job: Job, study: Any, target: int) -> tuple[studies.Tally, Any]:
    """The study's tally, and a trial for this process to run (None: none is left to start).

    Under the sweep directory's claim lock: SQLite has no row locks, so two processes started
    together would both read a dead process's trial as RUNNING and both queue it again (one
    directory, two runs writing it), or both pop the same queued trial. Processes on other
    machines (a server storage) are kept apart by `excess` and the storage's own row locks."""
    with exclusive(job.output_dir / CLAIM_LOCK):
        studies.reap(study)
        now = studies.tally(study)
        if now.finished + now.running >= target:
            return now, None
        trial = study.ask(studies.distributions(job.entries))
        studies.claim(study, trial)
        if studies.excess(study, trial.number, target):  # asked at the same moment as another machine
            trial.set_user_attr("reason", f"not run: the study already had {target} trials")
            _tell(study, trial, state=_state("FAIL"))
            return studies.tally(study), None
        return now, trial


def _state(name: str):
    from optuna.trial import TrialState

    return getattr(TrialState, name)


def trial_dir(job: Job, trial) -> Path:
    """A trial run again keeps the directory (and checkpoint) of the one it replaces."""
    inherited = trial.user_attrs.get("output_dir")
    return Path(inherited) if inherited else job.output_dir / f"trial-{trial.number:04d}"


def study_trial(trial):
    """The stored record of a running trial (its system attributes: a retry names the trial it replaces)."""
    return trial.study._storage.get_trial(trial._trial_id)


def trial_config(job: Job, trial, directory: Path):
    """The trial's Resolved: the sweep's sources, and its values as a `sweep` layer above them."""
    from overdrive.resolving import resolve

    retry_of = study_trial(trial).system_attrs.get("failed_trial")
    header = trial_layer.trial_header(trial.number, studies.study_name(job.config), retry_of)
    layer = trial_layer.write(directory, {**trial.params, "output_dir": str(directory)}, header)
    return resolve(job.files, cli=job.cli, accelerate_default=job.accelerate_default, above=[layer])


def run_trial(job: Job, study, trial, starter, signals: _Signals, show) -> Execution:
    """Train one trial, report its metric for pruning, tell Optuna how it ended."""
    import optuna

    from overdrive import checkpoint

    directory = trial_dir(job, trial)
    trial.set_user_attr("output_dir", str(directory))
    try:
        resolved = trial_config(job, trial, directory)
    except UserError as error:  # a combination the cross-field rules refuse
        reason = error.render().replace("\n", " ")
        trial.set_user_attr("reason", reason[:500])
        _tell(study, trial, state=_state("FAIL"))
        return Execution("failed", reason=reason)
    found = checkpoint.latest_complete(checkpoint.checkpoints_dir(directory), checksums=False).found
    if found is not None:
        trial.set_user_attr("resumed_from", str(found.path))
    last_beat = [time.monotonic()]

    def on_value(step: int, value: float) -> bool:
        trial.report(value, step)
        if trial.should_prune():
            trial.set_user_attr("pruned_at_step", step)
            return True
        return False

    def tick() -> None:
        if time.monotonic() - last_beat[0] >= studies.HEARTBEAT_S:
            study._storage.record_heartbeat(trial._trial_id)
            last_beat[0] = time.monotonic()
        show(study)

    outcome = execute(resolved.to_json(), directory, starter, job.config.sweep.metric, on_value=on_value,
                      on_start=lambda pid: studies.claim(study, trial, pid), tick=tick,
                      interrupted=lambda: bool(signals.received))
    trial.set_user_attr("steps", outcome.step)
    trial.set_user_attr("seconds", round(outcome.seconds, 2))
    try:
        if outcome.status == "finished":
            _tell(study, trial, outcome.value)
        elif outcome.status == "stopped":
            _tell(study, trial, state=_state("PRUNED"))
        elif outcome.status == "interrupted":  # queued again: the next sweep continues its checkpoint
            studies.fail_and_retry(study, trial._trial_id)
        else:
            trial.set_user_attr("reason", outcome.reason[:500])
            _tell(study, trial, state=_state("FAIL"))
    except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale by another process meanwhile
        pass
    if outcome.status == "failed" and outcome.reason.startswith(f"no `{job.config.sweep.metric}`"):
        raise UserError(Problem("sweep.metric", f"trial {trial.number} finished without it: {outcome.reason}",
                                fix="name a field the runs write (eval_loss needs evaluation: training.eval_every_steps "
                                "or the evaluation at the end)"))
    show(study)
    return outcome


def _tell(study: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
    """`study.tell`, through Optuna's GridSampler too: after the grid's last trial it calls
    `study.stop()`, which raises outside `optimize` once the trial is already stored (optuna #4121,
    #5141); the loop's own count ends the sweep there."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as error:
        if "Study.stop" not in str(error):
            raise

