"""What a job is checked for before it is written or started: the one function `train`'s own
checks reach a cluster script through (slurm, k8s, skypilot), so none writes a job that train
on the cluster's machines would refuse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def layout_problems(cfg: RunConfig) -> list[Problem]:
    """The model's heads, tensor-parallel plan, experts and layers against the layout, read from its
    config alone (no weights), and what the loop does not do (sequence parallel): the rules of
    resolving/validate_model.py, asked only when the layout or the experts ask the model's shape (a
    cluster job's model need not be readable on the machine that writes it)."""
    from overdrive.resolving.validate_model import asks_the_shape, model_rules

    if not asks_the_shape(cfg):
        return []
    found, unreadable = model_rules(cfg)
    return found + unreadable


def cluster_problems(cfg: RunConfig, supplied: Sequence[str] = ()) -> list[Problem]:
    """Every check `train` makes before it starts, judged for the cluster's machines (their GPUs,
    not this one's); `supplied`: keys the cluster fills in itself (the rendezvous address)."""
    from overdrive.launch.workers import problems
    from overdrive.strategies.cpu import target_gpus

    found = [p for p in problems(cfg, gpus=target_gpus(cfg)) if p.key not in supplied]
    return found + layout_problems(cfg)
