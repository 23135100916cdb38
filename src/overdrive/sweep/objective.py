"""For those who drive Optuna or Ray Tune themselves: one config trained as a real
`overdrive train` in a child process, its metric handed back as it is written.

    import optuna
    from overdrive.sweep import objective

    study = optuna.create_study()
    study.optimize(objective("run.yaml", space=lambda t: {"optim.lr": t.suggest_float("lr", 1e-4, 1e-2, log=True)}),
                   n_trials=20)

`run_config(load_config("run.yaml", overrides={...}), report=...)` is the same without
Optuna: `report(step, value)` sees each value of the metric (Ray Tune's `tune.report`), and
a True answer stops the run (`Stopped` is raised).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


class Stopped(Exception):
    """`report` answered True: the run was stopped at `step` (a pruned trial)."""

    def __init__(self, step: int):
        super().__init__(f"stopped at step {step}")
        self.step = step


def run_config(run, *, metric: str = "eval_loss", report: Optional[Callable[[int, float], bool]] = None,
               runner: str = "spawn") -> float:
    """Train `run` (a RunConfig from `load_config`, or a Resolved) in a child process, as
    `overdrive train` would, in its output_dir; return the metric's last value there."""
    from overdrive.sweep.execute import execute
    from overdrive.training.build.settle import as_resolved
    from overdrive.tune import starter_for

    resolved = as_resolved(run)
    out = Path(resolved.config.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=".run-", dir=out))
    starter = starter_for(resolved.config, runner, root)
    try:
        outcome = execute(resolved.to_json(), out, starter, metric, on_value=report or (lambda step, value: False))
    finally:
        starter.close()
        shutil.rmtree(root, ignore_errors=True)
    if outcome.status == "stopped":
        raise Stopped(outcome.step)
    if outcome.status != "finished":
        raise RuntimeError(f"the run in {out} failed: {outcome.reason} (log: {outcome.log})")
    return outcome.value


def objective(*files: str, space: Callable[[Any], dict[str, Any]], metric: str = "eval_loss",
              output_dir: Optional[str] = None, cli: Sequence[str] = (), runner: str = "spawn") -> Callable[[Any], float]:
    """An Optuna objective: `space(trial)` gives {dotted key: value}, applied with
    `load_config(*files, overrides=...)`; each trial trains in `<output_dir>/trial-NNNN`,
    reports the metric for pruning and returns its last value."""
    from overdrive.resolving import load_config

    base = output_dir or load_config(*files, cli=cli).output_dir

    def run_trial(trial) -> float:
        import optuna

        values = space(trial)
        cfg = load_config(*files, cli=cli, overrides={**values, "output_dir": f"{base}/trial-{trial.number:04d}"})

        def report(step: int, value: float) -> bool:
            trial.report(value, step)
            return trial.should_prune()

        try:
            return run_config(cfg, metric=metric, report=report, runner=runner)
        except Stopped:
            raise optuna.TrialPruned() from None

    return run_trial
