"""`parallel.deepspeed.*` -> the DeepSpeed config dict (strategies/deepspeed_config.py) -> DeepSpeedPlugin.

The optimizer: overdrive hands DeepSpeed a client optimizer (built by the trainer from
`optim.*`, the same parameter groups and schedule as under DDP and FSDP) and writes no
`optimizer` section, except with `optim.name=deepspeed` (a DeepSpeed JSON naming Lamb,
OneBitAdam, ...), where DeepSpeed builds the optimizer from that block. With optimizer
offload, Accelerate swaps AdamW for DeepSpeedCPUAdam (same groups, adamw_mode) at prepare
time; that op is compiled with ninja/gcc on first use. Where it cannot be built, and for
every other optimizer (see `forces_ds_cpu_optimizer`), `zero_force_ds_cpu_optimizer: false`
keeps the torch optimizer running on the offloaded fp32 master weights instead.
"""

from __future__ import annotations

import functools
from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.strategies.deepspeed_config import ds_config
from overdrive.strategies import common, library_features


# --------------------------------------------------------------------------- plugin


@functools.lru_cache(maxsize=None)
def cpu_optimizer_available(builder: str = "CPUAdamBuilder") -> bool:
    """Whether one of DeepSpeed's CPU optimizers (CPUAdamBuilder: DeepSpeedCPUAdam,
    CPULionBuilder: DeepSpeedCPULion) can be built or loaded here (JIT-compiled with ninja/gcc)."""
    try:
        from deepspeed.ops import op_builder

        getattr(op_builder, builder)().load(verbose=False)
        return True
    except Exception:
        return False


def cpu_adam_available() -> bool:
    return cpu_optimizer_available("CPUAdamBuilder")


def forces_ds_cpu_optimizer(cfg: RunConfig) -> bool:
    """Whether to let DeepSpeed insist on its own CPU optimizer under optimizer offload.

    With `zero_force_ds_cpu_optimizer` on (DeepSpeed's default), Accelerate replaces *any*
    torch optimizer by DeepSpeedCPUAdam at prepare time (accelerate.utils.deepspeed.
    map_pytorch_optim_to_deepspeed): right for Adam and AdamW, silently wrong for SGD or Lion.
    So it stays on only for Adam/AdamW where DeepSpeedCPUAdam builds; the trainer hands Lion
    DeepSpeed's own DeepSpeedCPULion itself (training/build/optimizers.py) and every other
    optimizer runs as torch code on the offloaded fp32 master weights."""
    import overdrive.config.optimizer_catalog as optimizer_catalog

    kind = optimizer_catalog.of(cfg)
    return kind.name in ("adamw", "adam") and cpu_adam_available()


@functools.lru_cache(maxsize=1)
def async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (nvme offload, libaio) can be built here."""
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
        return builder is not None and bool(builder.is_compatible())
    except Exception:
        return False


def plugin(cfg: RunConfig, world_size: int) -> Any:
    """DeepSpeedPlugin(hf_ds_config=dict), its other fields explicit so no ACCELERATE_DEEPSPEED_*
    variable can change them."""
    from accelerate.utils import DeepSpeedPlugin

    ds = cfg.parallel.deepspeed
    config = ds_config(cfg, world_size)
    if ds.offload_optimizer != "none" and cfg.optim.name != "deepspeed" and not forces_ds_cpu_optimizer(cfg):
        config["zero_force_ds_cpu_optimizer"] = False
    nvme = ds.nvme_path or "none"
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not async_io_available():
        from overdrive.errors import Problem, UserError

        raise UserError(Problem("parallel.deepspeed.nvme_path", "nvme offload needs DeepSpeed's async_io op, which "
                                "cannot be built here (libaio and its headers are missing)",
                                fix="install libaio-dev (apt) or libaio-devel (yum), or offload to cpu"))
    return DeepSpeedPlugin(
        hf_ds_config=config,
        gradient_accumulation_steps=cfg.training.gradient_accumulation_steps,
        gradient_clipping=cfg.training.gradient_clipping or 0.0,
        zero_stage=ds.zero_stage,
        offload_optimizer_device=ds.offload_optimizer,
        offload_param_device=ds.offload_param,
        offload_optimizer_nvme_path=nvme,
        offload_param_nvme_path=nvme,
        zero3_init_flag=ds.zero3_init and ds.zero_stage == 3,
        zero3_save_16bit_model=ds.zero3_save_16bit_model,
        **library_features.deepspeed_plugin_fp8_kwargs(
            cfg.precision.mixed_precision == "fp8" and cfg.precision.fp8.backend == "MSAMP", cfg.precision.fp8.opt_level),
    )


def accelerator_kwargs(cfg: RunConfig, world_size: int, gpus: int | None = None) -> dict[str, Any]:
    kwargs = common.base_kwargs(cfg, world_size, gpus)
    kwargs["deepspeed_plugin"] = plugin(cfg, world_size)
    return kwargs


def after_construction(accelerator: Any, cfg: RunConfig) -> None:
    """Honour `parallel.deepspeed.zero3_init=false` (the default): build models whole.

    Accelerate (1.15) registers a ZeRO-3 config with Transformers whenever the plugin is
    selected, whatever `zero3_init_flag` says, and Transformers then builds every model
    under `deepspeed.zero.Init`: each parameter an empty placeholder from birth, so code
    that reads shapes (weight-decay groups by ndim, for one) sees 1-D tensors. Without the
    registration the model is built whole and DeepSpeed partitions it in prepare().
    """
    ds = cfg.parallel.deepspeed
    if ds.zero_stage != 3 or ds.zero3_init:
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    accelerator.state.deepspeed_plugin.dschf = None


def shard_fraction(model: Any) -> float:
    """Fraction of parameter elements this rank holds. Under ZeRO-3 each parameter is a
    partition (`ds_tensor`) of its full size (`ds_numel`); otherwise every rank holds all."""
    local = total = 0
    for param in model.parameters():
        full = getattr(param, "ds_numel", param.numel())
        total += full
        part = getattr(param, "ds_tensor", None)
        local += part.numel() if part is not None else full
    return local / max(total, 1)
