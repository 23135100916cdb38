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


def matmul_precision(mixed_precision: str, model) -> str:
    """The precision the model's matmuls run in, as `precision.mixed_precision` names it (what a
    device's peak, and so MFU, is read at): autocast's when there is one, else the dtype most of
    the weights are stored in: bf16 weights without autocast compute in bf16, and compared with
    the fp32 peak their MFU would read 15x too high on an H100."""
    if mixed_precision != "no":
        return mixed_precision
    sizes: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    most = max(sizes, key=sizes.get) if sizes else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(most, "no")
