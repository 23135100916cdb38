"""Cross-key rules of the GPU paths: combinations the libraries would accept and then run
wrongly (or crash on at the first step), refused by key before a job starts.

- context parallel: Accelerate's CP hooks make every attention causal and drop the mask, so
  what relies on a mask (packed conversations, classification's padding) would be wrong;
- fp8 with a 4-bit base: Accelerate's fp8 engines convert Linear layers, bitsandbytes' are not
  Linear, and a frozen 4-bit base gains nothing from fp8 matmuls; neither is applied;
- MS-AMP with FSDP: Accelerate raises only inside `prepare` (MS-AMP is DeepSpeed's or DDP's);
- LoRA with tensor parallel: PEFT wraps each Linear with plain-tensor A and B matrices, while
  Transformers' tp plan makes the base weights DTensors sharded by rows or columns: the adapter
  is not split by the plan, and the two do not combine in one matmul.
"""

from __future__ import annotations

from typing import Any, Callable

from overdrive.errors import Problem
from overdrive.strategies import layout, registry


def check(cfg: Any, where: Callable[[str], str]) -> list[Problem]:
    return _context_parallel(cfg, where) + _precision(cfg, where) + _tensor_parallel(cfg, where)


def warnings(cfg: Any, where: Callable[[str], str]) -> list[Problem]:
    """What runs, at a cost worth saying before it starts."""
    tp = layout.layout(cfg).tp
    if tp <= 1 or not cfg.model.name_or_path or cfg.model.from_scratch:
        return []
    return [Problem("parallel.tp_size", f"with pretrained weights every one of the {tp} ranks of a tensor-parallel "
                    "group loads the whole checkpoint into host memory, then keeps its slice: host memory for "
                    f"{tp} copies of the model per machine", where("model.name_or_path"),
                    "make sure the machines' RAM holds them, or shard with FSDP (parallel.tp_size=1)")]


def _context_parallel(cfg: Any, where: Callable[[str], str]) -> list[Problem]:
    cp, found = layout.layout(cfg).cp, []
    if cp <= 1:
        return found
    if cfg.data.format == "chat" and cfg.data.packing:
        found.append(Problem("data.packing", f"context parallel (parallel.cp_size={cp}) makes every attention causal "
                             "over the whole row and drops its mask: packed conversations would attend to each other",
                             where("data.packing"), "set data.packing=false (one conversation per row), or "
                             "parallel.cp_size=1"))
    if cfg.model.task == "sequence-classification":
        found.append(Problem("model.task", f"context parallel (parallel.cp_size={cp}) drops the attention mask the "
                             "classifier's padding relies on, and splits the row whose last token it reads",
                             where("model.task"), "set parallel.cp_size=1 for sequence classification"))
    return found


def _precision(cfg: Any, where: Callable[[str], str]) -> list[Problem]:
    prec, found = cfg.precision, []
    if prec.mixed_precision != "fp8":
        return found
    if cfg.peft.method == "qlora":
        found.append(Problem("precision.mixed_precision", "fp8 does not apply to a 4-bit base: Accelerate's fp8 "
                             "engines convert torch Linear layers, and bitsandbytes' 4-bit layers are not; the run "
                             "would neither use fp8 nor say so", where("precision.mixed_precision"),
                             "set precision.mixed_precision=bf16 with peft.method=qlora (or peft.method=lora with fp8)"))
    if prec.fp8.backend not in registry.of(cfg).fp8_backends:
        found.append(Problem("precision.fp8.backend", "MS-AMP does not run under FSDP (Accelerate refuses it when "
                             "the model is prepared)", where("precision.fp8.backend"),
                             "set precision.fp8.backend=TE or AO with FSDP, or use MS-AMP with ddp or deepspeed"))
    return found


def _tensor_parallel(cfg: Any, where: Callable[[str], str]) -> list[Problem]:
    tp = layout.layout(cfg).tp
    if tp <= 1 or cfg.peft.method == "none":
        return []
    return [Problem("parallel.tp_size", f"{cfg.peft.method} adapters on a tensor-parallel base (tp_size={tp}): "
                    "PEFT's A and B matrices are plain tensors that Transformers' tp plan does not split, beside "
                    "base weights sharded as DTensors", where("parallel.tp_size"),
                    "shard an adapter run with FSDP (parallel.tp_size=1), which shards frozen and trained "
                    "tensors alike")]
