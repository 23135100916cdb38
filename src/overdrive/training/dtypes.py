"""The one map from the config's dtype names to torch's, and the dtype autocast computes in."""

from __future__ import annotations

from typing import Optional

import torch

# The one map from the config's dtype names (model.dtype) to torch's.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# precision.mixed_precision -> the dtype autocast computes in (None: no autocast). Accelerate
# runs fp8 training's other operations under a bf16 autocast, so fp8 reads bf16 here.
_AUTOCAST = {"no": None, "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}


def autocast_dtype(mixed_precision: str) -> Optional[torch.dtype]:
    name = _AUTOCAST.get(mixed_precision)
    return DTYPES[name] if name else None
