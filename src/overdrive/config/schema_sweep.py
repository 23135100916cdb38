"""`sweep.*`: a hyperparameter search with Optuna over any config key (`overdrive sweep`).

Only `overdrive sweep` reads this section; `overdrive train` ignores it, so one file can hold
a run and its search. Each entry of `space` is checked against the schema when the config
loads (config/sweep_space.py), before any trial starts.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from overdrive.config.sections import Section

# The numeric fields a run writes to metrics.jsonl that a sweep may judge it by (`sweep.metric`).
KNOWN_FIELDS = ("eval_loss", "eval_perplexity", "eval_accuracy", "loss", "tokens_per_s", "mfu", "peak_memory_mb",
                "grad_norm", "elapsed_s")


class SweepConfig(Section):
    """Hyperparameter search: every trial a real `overdrive train`, the study kept in an Optuna storage."""

    trials: int = Field(20, ge=1, description="Trials to finish (complete or pruned), over every process sharing the study.")
    storage: Optional[str] = Field(
        None, description="Optuna storage URL (`sqlite:///sweep.db`, `postgresql://...`, `mysql://...`). "
        "Empty: SQLite at `<output_dir>/sweep.db`.",
    )
    study_name: Optional[str] = Field(None, description="Study name in the storage. Empty: the name of `output_dir`.")
    metric: str = Field("eval_loss", description="The metrics.jsonl field a trial is judged by: its last value is the trial's value.")
    direction: Literal["minimize", "maximize"] = Field("minimize", description="Whether a lower or a higher `metric` is better.")
    sampler: Literal["tpe", "random", "grid", "cmaes"] = Field(
        "tpe", description="Optuna sampler. `grid` needs every space entry to be a list or a range with a `step`."
    )
    pruner: Literal["median", "hyperband", "none"] = Field(
        "median", description="Stops trials whose intermediate `metric` values are behind the others'."
    )
    seed: Optional[int] = Field(None, ge=0, description="Seed of the sampler. Empty: a fresh one each time.")
    space: dict[str, Any] = Field(
        default_factory=dict,
        description="What to search: {dotted key: {low, high, log, step}} for a range, or {dotted key: [choices]}. "
        "E.g. `optim.lr: {low: 1e-4, high: 1e-2, log: true}`, `training.micro_batch_size: [4, 8]`.",
    )
