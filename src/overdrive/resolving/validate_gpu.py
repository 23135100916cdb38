"""Cross-key rules of the GPU paths: combinations the libraries would accept and then run
wrongly (or crash on at the first step), refused by key before a job starts.

- fp8 with a 4-bit base: Accelerate's fp8 engines convert Linear layers, bitsandbytes' are not
  Linear, and a frozen 4-bit base gains nothing from fp8 matmuls; neither is applied;
- MS-AMP with FSDP: Accelerate raises only inside `prepare` (MS-AMP is DeepSpeed's or DDP's);
- MS-AMP where the installed Accelerate no longer has it (1.16 removed it): a TypeError at start.

Which objective composes with which layout, adapter and attention: resolving/composition.py.
"""

from __future__ import annotations

from typing import Callable

from overdrive.config.schema import RunConfig

from overdrive.errors import Problem
from overdrive.strategies import layout, library_features, registry


def check(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    return _precision(cfg, where)


def warnings(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """What runs, at a cost worth saying before it starts."""
    tp = layout.layout(cfg).tp
    if tp <= 1 or not cfg.model.name_or_path or cfg.model.from_scratch:
        return []
    return [Problem("parallel.tp_size", f"with pretrained weights every one of the {tp} ranks of a tensor-parallel "
                    "group loads the whole checkpoint into host memory, then keeps its slice: host memory for "
                    f"{tp} copies of the model per machine", where("model.name_or_path"),
                    "make sure the machines' RAM holds them, or shard with FSDP (parallel.tp_size=1)")]


def _precision(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
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
    elif prec.fp8.backend == "MSAMP" and not library_features.msamp_supported():
        found.append(Problem("precision.fp8.backend", "is MSAMP, but the installed Accelerate has no MS-AMP support "
                             "(removed in Accelerate 1.16)", where("precision.fp8.backend"),
                             "set precision.fp8.backend=TE (Transformer Engine) or AO (torchao), or install the "
                             "tested set (bash scripts/setup.sh), whose Accelerate still has MS-AMP"))
    return found
