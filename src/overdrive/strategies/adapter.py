"""What each strategy needs of an adapter run (LoRA, QLoRA): asked by resolving/validate_peft.py,
training/build/adapter.py and checkpoint/adapter_state.py.

- FSDP puts a block's tensors into one unit: FSDP2 shards each tensor on its own, so frozen and
  trained tensors share a unit as they are; FSDP1 flattens them into one, which needs
  `use_orig_params`; and packed 4-bit weights must be stored in the unit's float dtype.
- Packed 4-bit weights are bytes: a strategy that casts every float parameter (FSDP2's
  MixedPrecisionPolicy on each all-gather, DeepSpeed's bf16/fp16 engine at start) must find them
  already in the dtype it casts to, or it value-casts the bytes into garbage (on CPU: half of them
  gone, "shape [64, 32] is invalid for input of size 1024").
- ZeRO-3 partitions the frozen base like any parameter; a 4-bit base under it is not checked here.
- Who writes the model's checkpoint files decides how the frozen base is left out of them.

Pure: no torch, no accelerate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from overdrive.errors import Problem
from overdrive.strategies import registry

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


_CAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def cast_dtype(cfg: RunConfig) -> Optional[str]:
    """The dtype this strategy casts every float parameter to, frozen ones included, or None.
    FSDP2 under bf16/fp16: Accelerate's MixedPrecisionPolicy(param_dtype) on every all-gather
    (it skips its own fp32 upcast for Params4bit, not FSDP's cast). DeepSpeed under bf16/fp16:
    the engine casts the module's float parameters when it starts. DDP and autocast cast none."""
    strategy = registry.of(cfg)
    if strategy is registry.FSDP or strategy is registry.DEEPSPEED:
        return _CAST_DTYPES.get(cfg.precision.mixed_precision)
    return None


def quant_storage_dtype(cfg: RunConfig) -> str:
    """The dtype packed 4-bit weights are stored in, unless `peft.storage_dtype` says: under FSDP
    the dtype FSDP computes in (its mixed-precision dtype, else the model's float dtype: one dtype
    per unit, and a cast that leaves the bytes alone); elsewhere uint8, which no cast touches."""
    p = cfg.peft
    if p.storage_dtype != "auto":
        return p.storage_dtype
    if registry.of(cfg) is registry.FSDP:
        return cast_dtype(cfg) or (cfg.model.dtype if cfg.model.dtype in _FLOAT_DTYPES else "float32")
    return "uint8"


def checkpoint_writer(cfg: RunConfig) -> str:
    """Who writes an adapter run's model files, so the frozen base can be left out:
    `engine` (DeepSpeed's save_checkpoint), `full` (FSDP2's distributed checkpoint: every
    parameter), or `state_dict` (Accelerate's own weights file)."""
    strategy = registry.of(cfg)
    if strategy.engine_steps_optimizer:
        return "engine"
    return "full" if strategy is registry.FSDP else "state_dict"


def problems(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """What this strategy cannot do with the `peft:` section asked for."""
    p, strategy = cfg.peft, registry.of(cfg)
    found: list[Problem] = []
    if p.method == "none":
        return found
    f = cfg.parallel.fsdp
    if strategy is registry.FSDP and f.version == 1 and not f.use_orig_params:
        found.append(Problem("parallel.fsdp.use_orig_params", "FSDP1 flattens a unit's parameters into one, which "
                             "cannot mix the frozen base and the trained adapter", where("peft.method"),
                             "set parallel.fsdp.use_orig_params=true (FSDP2 needs nothing: it shards each tensor)"))
    if p.method != "qlora":
        return found
    if strategy is registry.DEEPSPEED and not strategy.holds_whole_model(cfg):
        found.append(Problem("peft.method", "qlora under ZeRO-3 is not supported by overdrive (a 4-bit base "
                             "partitioned by ZeRO-3 is not checked here)", where("peft.method"),
                             "use parallel.deepspeed.zero_stage=2, FSDP, or DDP with qlora"))
    if strategy is registry.FSDP and p.storage_dtype == "uint8":
        found.append(Problem("peft.storage_dtype", "FSDP shards a block's tensors together, in one dtype: 4-bit "
                             "weights stored as uint8 cannot share a unit with float weights",
                             where("peft.storage_dtype"), "set peft.storage_dtype=auto (FSDP's compute dtype: "
                             f"{cast_dtype(cfg) or cfg.model.dtype})"))
    cast = cast_dtype(cfg)
    if cast and p.bits == 4 and p.storage_dtype in _FLOAT_DTYPES and p.storage_dtype != cast:
        found.append(Problem("peft.storage_dtype", f"{strategy.name} casts every float parameter to {cast} under "
                             f"precision.mixed_precision={cfg.precision.mixed_precision}: 4-bit weights packed into "
                             f"{p.storage_dtype} would be value-cast, their bytes lost", where("peft.storage_dtype"),
                             f"set peft.storage_dtype=auto (or {cast}" + (", or uint8" if strategy is registry.DEEPSPEED
                                                                          else "") + ")"))
    if strategy is registry.FSDP and p.bits == 8:
        found.append(Problem("peft.bits", "8-bit bitsandbytes weights cannot be sharded by FSDP", where("peft.bits"),
                             "use peft.bits=4 with FSDP, or DDP"))
    return found
