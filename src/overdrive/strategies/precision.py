"""`precision.fp8.*` -> the FP8 recipe handler Accelerate is given.

Accelerate picks an FP8 engine in this order when it is given `mixed_precision="fp8"`
and no recipe: ACCELERATE_FP8_BACKEND (which overdrive does not pass on), else torchao if
installed, else Transformer Engine, else MS-AMP (before 1.16); and each recipe's empty fields fall back to
ACCELERATE_FP8_* variables. So the recipe is always built here, every field from the config:
`precision.fp8.backend: TE` means Transformer Engine even where torchao is installed.
"""

from __future__ import annotations

from typing import Any, Optional

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

_ENGINES = {"TE": "Transformer Engine (pip install transformer-engine)", "AO": "torchao (pip install torchao)",
            "MSAMP": "MS-AMP"}


def fp8_recipe(cfg: RunConfig) -> Optional[Any]:
    """TERecipeKwargs, AORecipeKwargs or MSAMPRecipeKwargs for an fp8 run; None otherwise."""
    if cfg.precision.mixed_precision != "fp8":
        return None
    from accelerate.utils import AORecipeKwargs, TERecipeKwargs

    f = cfg.precision.fp8
    try:
        if f.backend == "TE":
            return TERecipeKwargs(
                fp8_format=f.fp8_format, amax_history_len=f.amax_history_len, amax_compute_algo=f.amax_compute_algo,
                interval=f.interval, margin=f.margin, override_linear_precision=tuple(f.override_linear_precision),
                use_autocast_during_eval=f.use_autocast_during_eval, use_mxfp8_block_scaling=False)
        if f.backend == "AO":
            if cfg.parallel.strategy == "fsdp" and cfg.parallel.fsdp.cpu_ram_efficient_loading:
                # Accelerate refuses the pair in Accelerator.__init__; said here by key instead.
                raise UserError(Problem("parallel.fsdp.cpu_ram_efficient_loading", "cannot be combined with torchao fp8 "
                                        "(precision.fp8.backend=AO) under FSDP2",
                                        fix="set parallel.fsdp.cpu_ram_efficient_loading=false"))
            # torchao's Float8LinearConfig has no format/amax/margin fields; Accelerate's defaults
            # (pad_inner_dim, fp8 all-gather under FSDP2) are stated so no variable changes them.
            return AORecipeKwargs(pad_inner_dim=True, enable_fsdp_float8_all_gather=True)
        from accelerate.utils import MSAMPRecipeKwargs  # gone from Accelerate 1.16: refused by validation there

        return MSAMPRecipeKwargs(opt_level=f.opt_level)
    except ImportError as error:
        raise UserError(Problem("precision.fp8.backend", f"is {f.backend}, but {_ENGINES[f.backend]} is not "
                                f"installed here ({error})",
                                fix="install it, or choose another precision.fp8.backend (TE, AO, MSAMP)")) from None
