"""Each strategy's own rules for its settings section: what its keys may not combine to.

`registry.of(cfg).setting_problems(cfg, where)` asks them; resolving/validate.py gathers them
with the other cross-field rules. `where(key)` says where a key's value was set. Pure: no
torch, no accelerate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

Where = Callable[[str], str]
Found = tuple[list[Problem], list[Problem]]  # (errors, warnings)


def none(cfg: RunConfig, where: Where) -> Found:
    return [], []


def deepspeed(cfg: RunConfig, where: Where) -> Found:
    import overdrive.config.batch as batch

    errors, warnings = [], []
    ds = cfg.parallel.deepspeed
    if ds.offload_param != "none" and ds.zero_stage < 3:
        errors.append(Problem("parallel.deepspeed.offload_param", f"offloads parameters, which needs ZeRO-3 (zero_stage is {ds.zero_stage})",
                              where("parallel.deepspeed.offload_param"), "set parallel.deepspeed.zero_stage=3 or offload_param=none"))
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        errors.append(Problem("parallel.deepspeed.offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3",
                              where("parallel.deepspeed.offload_optimizer"), "set parallel.deepspeed.zero_stage=2"))
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
        errors.append(Problem("parallel.deepspeed.nvme_path", "nvme offload needs a directory", where("parallel.deepspeed.offload_optimizer"),
                              "set parallel.deepspeed.nvme_path to a directory on a fast local disk"))
    if ds.activation_checkpointing and not cfg.model.gradient_checkpointing:
        # DeepSpeed's section configures deepspeed.checkpointing.checkpoint, which only models
        # written for it call; Transformers models checkpoint through torch.utils.checkpoint.
        warnings.append(Problem("parallel.deepspeed.activation_checkpointing", "has no effect on Transformers models "
                                "(they do not call DeepSpeed's checkpointing)", where("parallel.deepspeed.activation_checkpointing"),
                                "set model.gradient_checkpointing=true to recompute activations"))
    split = batch.split(cfg)
    if ds.train_batch_size is not None and split.micro is not None and ds.train_batch_size != split.global_batch:
        errors.append(Problem(
            "parallel.deepspeed.train_batch_size",
            f"is {ds.train_batch_size}, but micro-batch {split.micro} x accumulation {split.accumulation} "
            f"x world size {split.data_parallel} = {split.global_batch}",
            where("parallel.deepspeed.train_batch_size"),
            'write "auto" for train_batch_size, or change the micro-batch, accumulation or num_processes'))
    return errors, warnings


def fsdp(cfg: RunConfig, where: Where) -> Found:
    f = cfg.parallel.fsdp
    if f.version == 1 and f.offload_params and not f.reshard_after_forward:
        return [], [Problem("parallel.fsdp.offload_params", "CPU offload with SHARD_GRAD_OP is unsupported by FSDP1",
                            where("parallel.fsdp.offload_params"))]
    return [], []
