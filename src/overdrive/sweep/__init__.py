"""Sweeps: Optuna over any config key, every trial a real `overdrive train`.

    job = make_job(resolve(["run.yaml"]), files=["run.yaml"])   # the space checked when the config loaded
    finish = run(job, open_study(job))                          # until `sweep.trials` are finished

Layout: study.py (storage, study, sampler, pruner, counting trials, trials whose process
died) · loop.py (ask, train, tell) · execute.py (one run in a child process,
watched through its metrics.jsonl) · trial_layer.py (a trial's values as a `sweep` layer) ·
table.py (progress and summary) · outputs.py (best.yaml, report/, sweep.json) ·
objective.py (for those who drive Optuna or Ray Tune themselves).

Trials run in child processes started the tuner's way (tune/processes.py); the space itself
is read and checked with the config (config/sweep_space.py).
"""

from __future__ import annotations

from overdrive.sweep.objective import Stopped, objective, run_config
from overdrive.sweep.loop import Finish, Job

__all__ = ["Finish", "Job", "Stopped", "make_job", "objective", "open_study", "run", "run_config"]


def make_job(resolved, files=(), cli=(), accelerate_default: bool = True, runner: str = "fork") -> Job:
    """A sweep of this resolved config (its files and command-line items are what each trial resolves)."""
    from overdrive.config.sweep_space import parse_space
    from overdrive.errors import Problem, UserError

    entries, problems = parse_space(resolved.config, resolved.chains)
    if problems:
        raise UserError(problems)
    if not entries:
        raise UserError(Problem("sweep.space", "is empty: there is nothing to search",
                                fix="e.g. sweep.space: {optim.lr: {low: 1e-4, high: 1e-2, log: true}}"))
    return Job(resolved, entries, list(files), list(cli), accelerate_default, runner)


def open_study(job: Job):
    """The study in its storage (created, or continued when it exists): refused by key when
    the storage cannot be opened or the study was started with another metric or space."""
    from overdrive.sweep import study

    where = ""
    chain = job.resolved.chains.get("sweep.storage")
    if chain:
        where = str(chain[-1].origin)
    storage = study.open_storage(job.config, where)
    return study.open_study(job.config, job.entries, storage, job.resolved.chains)


def run(job: Job, study, show=lambda study: None) -> Finish:
    from overdrive.sweep import loop

    loop.check_output_dir(job, study)
    return loop.run(job, study, show)
