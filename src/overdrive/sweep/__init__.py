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

from overdrive.sweep.job import (  # noqa: F401  (the package's names)
    Finish, Job, Stopped, make_job, objective, open_study, run, run_config,
)
