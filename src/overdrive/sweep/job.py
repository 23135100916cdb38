"""One sweep: the job built from a resolved config, its Optuna study opened, and the ask-train-tell
loop run to its end."""

from __future__ import annotations

from overdrive.sweep.objective import Stopped, objective, run_config  # noqa: F401  (handed on by the package)
from overdrive.sweep.loop import Finish, Job



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
