"""Cross-field rules of the recipe (optimizer, schedule, data mixture), checked when the config loads.

The optimizer against the strategy: under ZeRO the optimizer steps on flattened fp32
partitions (a tensor may be cut anywhere), under FSDP2 on DTensor shards; an optimizer that
factors (Adafactor), orthogonalises (Muon) or block-quantises (8-bit AdamW) whole matrices
would compute something else there, so it is refused naming `optim.name`. Schedule-free
AdamW is refused under ZeRO: it swaps its evaluation point into the parameters it steps,
which under ZeRO are DeepSpeed's fp32 partitions, not the model's weights.

`optim.kwargs` are checked against the optimizer class's own signature (that imports the
class, so torch, only when kwargs or a class path are given).
"""

from __future__ import annotations

from typing import Callable

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem
from overdrive.strategies import registry
import overdrive.config.optimizer_catalog as optimizer_catalog


def check(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    return optimizer_problems(cfg, where) + mixture_problems(cfg, where)


def mixture_problems(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    sources, problems = cfg.data.sources, []
    if not sources:
        return problems
    if sum(s.weight for s in sources) <= 0:
        problems.append(Problem("data.sources", "every weight is 0: nothing would be drawn", where("data.sources"),
                                "give at least one source a weight above 0"))
    names = [s.name for s in sources]
    for i, name in enumerate(names):
        if name in names[:i]:
            problems.append(Problem(f"data.sources.{i}.name", f"{name!r} names two sources",
                                    where("data.sources"), "give each source its own name"))
    if cfg.model.task == "sequence-classification" and any(s.source == "stdlib" for s in sources):
        problems.append(Problem("data.sources", "the standard-library corpus has no labels for classification",
                                where("data.sources"), "mix labelled data sets only"))
    return problems


def optimizer_problems(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    o, problems = cfg.optim, []
    kind = optimizer_catalog.of(cfg)
    if o.class_path and o.name != "adamw":
        problems.append(Problem("optim.class_path", f"and optim.name={o.name} both name an optimizer",
                                where("optim.class_path"), "set one of them"))
    if kind.name == "schedule_free_adamw" and cfg.scheduler.name != "constant":
        problems.append(Problem("scheduler.name", f"is {cfg.scheduler.name}, but schedule-free AdamW replaces the "
                                "schedule (it warms up over scheduler.warmup_steps itself, then holds the lr)",
                                where("scheduler.name"), "set scheduler.name=constant"))
    strategy = registry.of(cfg)
    sees = strategy.optimizer_sees(cfg)
    if sees != "whole" and not kind.elementwise:
        problems.append(Problem("optim.name", f"{o.name} needs whole matrices, but under {strategy.label(cfg)} the "
                                f"optimizer steps on {sees} of them", where("optim.name"),
                                "use parallel.strategy=ddp, or an elementwise optimizer (adamw, adam, sgd, lion)"))
    if kind.name == "schedule_free_adamw" and sees == "flat partitions":
        problems.append(Problem("optim.name", "schedule_free_adamw swaps its evaluation point into the parameters it "
                                "steps; under ZeRO those are DeepSpeed's fp32 partitions, not the model's weights",
                                where("optim.name"), "use parallel.strategy=ddp or fsdp"))
    if kind.name == "deepspeed" and not strategy.deepspeed_config:
        problems.append(Problem("optim.name", "deepspeed (the DeepSpeed JSON's optimizer block) is built by DeepSpeed",
                                where("optim.name"), "set parallel.strategy=deepspeed, or choose another optim.name"))
    if cfg.scheduler.name == "polynomial" and cfg.scheduler.min_lr_ratio >= 1.0:
        problems.append(Problem("scheduler.min_lr_ratio", "polynomial decay needs a final lr below the peak",
                                where("scheduler.min_lr_ratio"), "set it below 1, or use scheduler.name=constant"))
    if o.kwargs or o.class_path:
        from overdrive.config.optimizer_classes import kwargs_problems

        problems += kwargs_problems(cfg, where)
    return problems
