"""The objectives a run can train, one entry each: how the builder knows which one a config asks
for, and how that one is built once the model is prepared.

    kind = chosen(cfg)              # the entry this config trains (the token objective by default)
    objective = kind.build(building)

An objective is its own module(s) here (its class: what a micro-batch's loss is, its metrics, the
guards' measure, a generation phase if it samples), its `build`, a line in KINDS, and its rows of
the composition table (resolving/composition.py: the layouts, adapters and features it runs
with, read by explain, plan, estimate and train alike). training/build/parts.py asks only this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from overdrive.config.batch import BatchSplit
from overdrive.config.schema import RunConfig
from overdrive.training.objectives import distill, grpo, preference, reference
from overdrive.training.objectives.objective import Objective, TokenObjective
from overdrive.training.step import loss_kernels

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator


@dataclass(frozen=True)
class Building:
    """What an objective is built from, once the model is prepared."""

    cfg: RunConfig
    accelerator: "Accelerator"
    model: "torch.nn.Module"  # prepared (DDP, FSDP2, DeepSpeed's engine)
    reference_model: Optional["torch.nn.Module"]  # the starting weights, frozen, where the run needs them
    tokenizer: Any
    tokens: Any  # the run's data: a token cache's splits, or an RL run's prompts
    collate: Any
    split: BatchSplit
    validates: bool  # a validation loader was built (the reference scores it too)
    say: Callable[[str], None]


@dataclass(frozen=True)
class Kind:
    name: str
    asked: Callable[[RunConfig], bool]
    build: Callable[[Building], Objective]


def _token(b: Building) -> Objective:
    """A causal LM's or a classifier's token loss, through the loss kernel the run names."""
    return TokenObjective(b.cfg.model.task, loss_kernels.for_run(b.cfg, b.accelerator.device))


def _preference(b: Building) -> Objective:
    """DPO, IPO, SimPO, ORPO, KTO, the reward model, with the reference the method needs."""
    validation = b.tokens.validation if b.validates else None
    train_ref, eval_ref = reference.for_run(b.cfg, b.accelerator, b.model, b.reference_model, b.tokens.train,
                                            b.collate, b.split.settled_micro(), Path(b.cfg.output_dir).expanduser(),
                                            validation)
    return preference.PreferenceObjective(b.cfg, b.accelerator, train_ref, eval_ref)


def _rl(b: Building) -> Objective:
    from overdrive.training.build import grpo_parts

    return grpo_parts.objective(b.cfg, b.accelerator, b.tokenizer, b.tokens, b.reference_model)


def _distill(b: Building) -> Objective:
    """The student's loss against a frozen teacher's distributions (or their cached top-k)."""
    return distill.objective(b.cfg, b.accelerator, b.tokenizer, b.tokens, b.say)


TOKEN = Kind("token", lambda cfg: True, _token)
# The first that a config asks for is the run's (validation refuses a config asking for two).
KINDS: tuple[Kind, ...] = (
    Kind("preference", preference.enabled, _preference),
    Kind("rl", grpo.enabled, _rl),
    Kind("distill", distill.enabled, _distill),
)


def chosen(cfg: RunConfig) -> Kind:
    """The objective `cfg` trains."""
    return next((kind for kind in KINDS if kind.asked(cfg)), TOKEN)
