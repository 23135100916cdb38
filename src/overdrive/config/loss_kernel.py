"""Which loss kernel computes a causal LM's token loss: the one rule `train`, `estimate` and `plan` ask.

`full` is the model's own loss: its LM head writes the logits (tokens x vocabulary, fp32 for the
cross entropy), the log-softmax keeps as many, and backward adds two more. `chunked` and `fused`
never hold them whole (training/step/loss_kernels.py); `auto` picks `fused` only where a fused GPU kernel
is installed (Liger, on CUDA) and `full` otherwise, so a run that does not ask keeps today's numbers.
Pure: no torch import, so `explain` and `estimate` stay fast.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

LossKernel = Literal["auto", "full", "chunked", "fused"]
KERNELS: tuple[str, ...] = ("auto", "full", "chunked", "fused")
CHUNK_LOGITS_BYTES = 64 * 2**20  # one slice's fp32 logits under `chunked`: 130 tokens at a 128k vocabulary


def chunk_tokens(vocab: int) -> int:
    """Tokens per slice of the chunked loss: one slice's fp32 logits take CHUNK_LOGITS_BYTES."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def fused_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of the fused kernels: Liger's and torch's chunked op size a chunk so its logits
    are about the size of the hidden states, the next power of two of tokens / ceil(vocab / hidden)
    (torch halves it again in fp32; the larger is counted)."""
    target = max(1, -(-tokens // -(-vocab // max(hidden, 1))))
    return min(tokens, 1 << (target - 1).bit_length())


def liger_installed() -> bool:
    """Liger's fused linear cross entropy (the `liger` extra) can be imported."""
    return importlib.util.find_spec("liger_kernel") is not None


def torch_has_linear_cross_entropy() -> bool:
    """torch >= 2.13 ships `F.linear_cross_entropy` with a chunked path (`LinearCrossEntropyOptions`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("torch").split("+")[0].split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (2, 13)


def chosen(kernel: str, device_type: str) -> str:
    """The kernel that runs for `training.loss_kernel: kernel` on a `device_type` ("cuda", "cpu", ...)."""
    if kernel != "auto":
        return kernel
    return "fused" if device_type == "cuda" and liger_installed() else "full"


def fused_available(device_type: str) -> bool:
    """`fused` has an implementation here: Liger on CUDA, or torch's own chunked op anywhere."""
    return (device_type == "cuda" and liger_installed()) or torch_has_linear_cross_entropy()
