"""The measured tuner: try candidates on this machine, keep the fastest that fits.

    job = make_job(resolve(["run.yaml"]), TuneOptions(budget_minutes=10))  # no torch
    result = lookup(job) or run(job)          # a cached answer, or a measured search

Layout: space.py (what may change, memory pruning) · trials.py (one candidate in a fresh
process, watched and killed from outside) · search.py (successive halving per stage, or the
full grid) · cache.py (fingerprint) · output.py (tuned.yaml, table, chart).

What tuning never changes: the global batch (micro x accumulation x processes), the data
order, the optimizer and the schedule. `result` is plain JSON: it is what the cache holds.
"""

from overdrive.tune.tuner import (  # noqa: F401  (the package's names)
    Candidate, DIMENSIONS, Job, Outcome, Rung, Search, SearchSettings, Space, TrialPlan, TuneOptions,
    assemble, build_space, detect_facts, lookup, make_job, open_starter, run, space_size,
    starter_for, trial_config,
)
