"""What a job is checked for before it is written or started: the one function `train`'s own
checks reach a cluster script through (slurm, k8s, skypilot), so none writes a job that train
on the cluster's machines would refuse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def layout_problems(cfg: RunConfig) -> list[Problem]:
    """The model's heads, tensor-parallel plan and layers against parallel.tp_size / sp_size / pp_size, read from
    its config alone (no weights), and what the loop does not do (sequence parallel)."""
    from overdrive.strategies import layout

    lay = layout.layout(cfg)
    moe = cfg.model.moe  # model.moe.top_k / aux_loss_coef are refused on a model without experts (config/experts.py)
    if (lay.tp == 1 and lay.sp == 1 and lay.pp == 1 and cfg.parallel.ep_size == 1 and cfg.peft.method != "qlora"
            and moe.top_k is None and moe.aux_loss_coef is None):
        return []
    from overdrive.config.experts import qlora_problems
    from overdrive.memory.model_shape import hf_config_for_run

    hf_config = hf_config_for_run(cfg)
    return (layout.loop_problems(cfg) + layout.model_problems(cfg, hf_config)
            + qlora_problems(cfg.peft.method, hf_config))  # a mixture of experts' stacked experts stay unquantized


def cluster_problems(cfg: RunConfig, supplied: Sequence[str] = ()) -> list[Problem]:
    """Every check `train` makes before it starts, judged for the cluster's machines (their GPUs,
    not this one's); `supplied`: keys the cluster fills in itself (the rendezvous address)."""
    from overdrive.launch.workers import problems
    from overdrive.strategies.cpu import target_gpus

    found = [p for p in problems(cfg, gpus=target_gpus(cfg)) if p.key not in supplied]
    return found + layout_problems(cfg)
