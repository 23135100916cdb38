"""Defaults that follow the user's own choices, each with an origin saying why, as the global
batch derives the accumulation: a default the user never chose is not a reason to refuse
their run. Only values a user set are refused (validate.py, recipe_rules.py).

    scheduler.warmup_steps  the default 40, capped at a tenth of training.max_steps: a 20-step
                            run warms up for 2 steps instead of never reaching its lr
    scheduler.name          constant under optim.name=schedule_free_adamw, which replaces the schedule
"""

from __future__ import annotations

from typing import Any, Mapping

from overdrive.config import optimizer_catalog
from overdrive.config.provenance import Origin, Setting, set_by_user

WARMUP, SCHEDULER = "scheduler.warmup_steps", "scheduler.name"
WARMUP_SHARE = 10  # the default warmup is at most 1/WARMUP_SHARE of the run


def follow(config: Any, chains: Mapping[str, list[Setting]]) -> tuple[Any, dict[str, Origin]]:
    """`config` with the defaults its user's choices contradict changed, and their origins."""
    scheduler, origins = {}, {}
    steps, warmup = config.training.max_steps, config.scheduler.warmup_steps
    # A warmup_ratio or a count in epochs says the user's own length (config/length.py settles those).
    counted = config.scheduler.warmup_ratio is not None or config.training.num_epochs is not None
    if not counted and not set_by_user(chains, WARMUP) and warmup > steps // WARMUP_SHARE:
        scheduler["warmup_steps"] = steps // WARMUP_SHARE
        origins[WARMUP] = Origin("derived", f"the default {warmup} capped at a tenth of training.max_steps={steps}")
    if (not set_by_user(chains, SCHEDULER) and config.scheduler.name != "constant"
            and optimizer_catalog.of(config).name == "schedule_free_adamw"):
        scheduler["name"] = "constant"
        origins[SCHEDULER] = Origin("derived", "optim.name=schedule_free_adamw replaces the schedule "
                                               f"(the default was {config.scheduler.name})")
    if not scheduler:
        return config, {}
    return config.model_copy(update={"scheduler": config.scheduler.model_copy(update=scheduler)}), origins
