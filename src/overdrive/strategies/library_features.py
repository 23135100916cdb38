"""What the installed Accelerate can do, asked of it rather than read off its version string.

The one place where an upstream API change is absorbed: the strategy builders and validation ask
these functions, so a release that drops or renames something changes one answer here, not
version comparisons scattered through the code. Each answer is read once per process.

- MS-AMP (fp8 through Microsoft's MS-AMP): Accelerate 1.16 removed it, with
  `DeepSpeedPlugin(enable_msamp=, msamp_opt_level=)`, `MSAMPRecipeKwargs` and the "MSAMP" fp8
  backend. Where it is gone, `precision.fp8.backend=MSAMP` is refused by key, naming the backends
  that remain.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.lru_cache(maxsize=1)
def msamp_supported() -> bool:
    """Whether the installed Accelerate still drives MS-AMP (its recipe handler exists and the
    DeepSpeed plugin takes `enable_msamp`)."""
    import accelerate.utils

    if not hasattr(accelerate.utils, "MSAMPRecipeKwargs"):
        return False
    return "enable_msamp" in inspect.signature(accelerate.utils.DeepSpeedPlugin).parameters


def deepspeed_plugin_fp8_kwargs(enable_msamp: bool, opt_level: str) -> dict[str, Any]:
    """The MS-AMP fields of DeepSpeedPlugin, passed only where the installed plugin has them.
    Stated explicitly where it does (so no ACCELERATE_DEEPSPEED_* variable sets them); validation
    has already refused MS-AMP where it does not (resolving/validate_gpu.py)."""
    if not msamp_supported():
        return {}
    return {"enable_msamp": enable_msamp, "msamp_opt_level": opt_level}
