"""How long a run is, and how long it warms up: `training.max_steps` or `training.num_epochs`,
`scheduler.warmup_steps` or `scheduler.warmup_ratio`.

The rule, written once: of each pair the one set in the later layer wins (a file's
`num_epochs: 3` and the command line's `max_steps=10`: 10 steps); the schema's defaults never
count as set. Both set in one file, each on a line of its own, is refused: the file says two
things. The loser is emptied in the resolved config (so the run reads one of them) and named in a
warning. A mixture's epoch is one pass's worth of samples over all its sources (the sum of their
samples, as the tools that concatenate data sets count it). Epochs become steps only once the data is known: `derived(cfg, samples)` when the run
starts (the token cache's exact sample count) and `overdrive plan` (its count or estimate); a
warmup ratio with `max_steps` is settled here at once.

The log interval follows the length when nobody set it: the default every 10 steps, but at least
about 20 log points in a shorter run (`log_interval`: a 20-step run logs every step).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

from overdrive.config.provenance import Origin, Setting
from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

PAIRS = (("training.max_steps", "training.num_epochs"), ("scheduler.warmup_steps", "scheduler.warmup_ratio"))


def _last_set(chain: Optional[list[Setting]]) -> Optional[Setting]:
    return next((s for s in reversed(chain or []) if s.origin.layer != "default"), None)


def settle(config, chains, order: dict[int, int]):
    """(config, {key: origin} of derived values, problems, warnings) by the rule above."""
    origins: dict[str, Origin] = {}
    problems: list[Problem] = []
    warnings: list[Problem] = []
    cleared: dict[str, Any] = {}
    for steps_key, other_key in PAIRS:
        section, name = other_key.split(".")
        if getattr(getattr(config, section), name) is None:
            continue
        steps, other = _last_set(chains.get(steps_key)), chains[other_key][-1]
        if steps is not None and steps.origin.source == other.origin.source and steps.origin.line \
                and other.origin.line and steps.origin.layer == other.origin.layer:
            problems.append(Problem(other_key, f"{steps_key} is set in the same file ({steps.origin}): one of the "
                                    "two decides", str(other.origin), f"remove {other_key} or {steps_key}"))
            continue
        if steps is None or order.get(id(other), 0) > order.get(id(steps), -1):
            continue  # the alternative wins
        warnings.append(Problem(other_key, f"not used: {steps_key} is set later ({steps.origin}), and the later one "
                                "wins", str(other.origin), "remove one of them to silence this"))
        cleared.setdefault(section, {})[name] = None
    for section, values in cleared.items():
        config = config.model_copy(update={section: getattr(config, section).model_copy(update=values)})
    t, s = config.training, config.scheduler
    if t.num_epochs is not None:
        origins["training.max_steps"] = Origin("derived", f"training.num_epochs={t.num_epochs:g} x steps per epoch, "
                                               "counted from the data when the run starts (see `overdrive plan`)")
        if s.warmup_ratio is not None:
            origins["scheduler.warmup_steps"] = Origin("derived", f"scheduler.warmup_ratio={s.warmup_ratio:g} x the "
                                                       "steps derived from training.num_epochs")
    elif s.warmup_ratio is not None:
        warmup = warmup_steps(s.warmup_ratio, t.max_steps)
        config = config.model_copy(update={"scheduler": s.model_copy(update={"warmup_steps": warmup})})
        origins["scheduler.warmup_steps"] = Origin("derived", f"scheduler.warmup_ratio={s.warmup_ratio:g} x "
                                                   f"training.max_steps={t.max_steps} = {warmup}")
    if t.num_epochs is None and _last_set(chains.get("training.log_every_steps")) is None:
        every = log_interval(t.max_steps, t.log_every_steps)
        if every != t.log_every_steps:
            config = config.model_copy(update={"training": config.training.model_copy(update={"log_every_steps": every})})
            origins["training.log_every_steps"] = Origin("derived", f"training.max_steps={t.max_steps}: about "
                                                         f"{LOG_POINTS} log points in a short run")
    return config, origins, problems, warnings


LOG_POINTS = 20


def log_interval(steps: int, default: int) -> int:
    """The default interval, or finer when a run of `steps` would log fewer than about LOG_POINTS times."""
    return max(1, min(default, steps // LOG_POINTS))


def warmup_steps(ratio: float, steps: int) -> int:
    return math.ceil(ratio * steps)  # as Transformers' TrainingArguments.get_warmup_steps


def steps_for(epochs: float, per_epoch: int) -> int:
    return max(1, math.ceil(epochs * per_epoch))


def derived(cfg: RunConfig, samples: int, global_batch: int):
    """The config with the steps (and warmup, evaluation and saving per epoch) counted from
    `samples` training samples: (config, {key: why}). Unchanged without epochs or per-epoch keys."""
    t, s, c = cfg.training, cfg.scheduler, cfg.checkpoint
    per_epoch = samples // global_batch  # the loader drops an incomplete last global batch
    notes: dict[str, str] = {}
    training, scheduler, checkpoint = {}, {}, {}
    if t.num_epochs is not None:
        if per_epoch < 1:
            raise ValueError(f"{samples} training samples make no global batch of {global_batch}")
        training["max_steps"] = steps_for(t.num_epochs, per_epoch)
        notes["training.max_steps"] = (f"training.num_epochs={t.num_epochs:g} x {per_epoch} steps per epoch "
                                       f"({samples} samples / global batch {global_batch})")
        if s.warmup_ratio is not None:
            scheduler["warmup_steps"] = warmup_steps(s.warmup_ratio, training["max_steps"])
            notes["scheduler.warmup_steps"] = f"scheduler.warmup_ratio={s.warmup_ratio:g} x {training['max_steps']} steps"
    if t.evals_per_epoch and per_epoch:
        training["eval_every_steps"] = max(1, per_epoch // t.evals_per_epoch)
        notes["training.eval_every_steps"] = f"{per_epoch} steps per epoch / training.evals_per_epoch={t.evals_per_epoch}"
    if c.saves_per_epoch and per_epoch:
        checkpoint["every_steps"] = max(1, per_epoch // c.saves_per_epoch)
        notes["checkpoint.every_steps"] = f"{per_epoch} steps per epoch / checkpoint.saves_per_epoch={c.saves_per_epoch}"
    update = {}
    for section, values in (("training", training), ("scheduler", scheduler), ("checkpoint", checkpoint)):
        if values:
            update[section] = getattr(cfg, section).model_copy(update=values)
    return (cfg.model_copy(update=update) if update else cfg), notes


MANY_EPOCHS = 10  # passes over the data a max_steps makes before the run says so


def passes_note(cfg: RunConfig, samples: int, global_batch: int) -> list[str]:
    """A run whose training.max_steps (not num_epochs) makes many passes over its data, said at
    its start: 500 steps over 1,200 rows of a global batch of 1,200 is 500 epochs, which a user
    counting steps does not see (and the model learns the rows by heart)."""
    t = cfg.training
    if t.num_epochs is not None or not samples or not t.max_steps:
        return []
    epochs = t.max_steps * global_batch / samples
    if epochs < MANY_EPOCHS:
        return []
    return [f"note: training.max_steps={t.max_steps:,} x global batch {global_batch:,} = {epochs:,.0f} epochs of "
            f"the {samples:,} training samples: each is seen about {epochs:,.0f} times (set training.num_epochs to "
            "count the length in passes over the data, or give more data)"]
