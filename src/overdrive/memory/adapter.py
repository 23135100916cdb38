"""Model states of an adapter run (LoRA, QLoRA): the frozen base as weights only, gradients
and optimizer states for the trained parameters alone.

With A trained parameters (the adapter, plus full copies of `peft.modules_to_save`) on a
base of P, of which Q are quantized (qlora: the blocks' linear weights) and U = P - Q are not:

    weights    base U x (its storage bytes) + Q x (bits/8 + quantization constants) + adapter
    gradients  A only (the base gets none: requires_grad is off)
    optimizer  the optimizer's state (Adam: two fp32 moments) for A only; DeepSpeed's fp32 master partition of A only
               (frozen parameters are not in the optimizer's groups, so ZeRO never flattens them)

Where the strategy shards, it shards the base too: ZeRO-3 partitions frozen parameters like
any other, FSDP2 shards each block with its adapter inside (frozen and trained tensors in one
unit); ZeRO-1/2 and DDP keep the whole base on every rank. The trainable count comes from
PEFT itself, applied to the model on the meta device (`adapter_shape`); for Llama-3-8B at
r=16 on every linear layer that is 41,943,040, the figure PEFT prints for it.

Quantization constants (bitsandbytes): one fp32 absmax per 64 weights (0.5 bit per weight);
with double quantization the absmax values are 8-bit with one fp32 constant per 256 of them
(0.127 bit per weight), QLoRA paper (Dettmers et al. 2023) sec. 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overdrive.memory.formulas import MASTER_BYTES, Row, _dtype
from overdrive.memory.shape import ModelShape, Setup


@dataclass(frozen=True)
class AdapterShape:
    method: str  # lora | qlora
    trainable: int
    quantized: int = 0  # base parameters stored in `bits`
    bits: int = 4
    double_quant: bool = True
    base_bytes: int = 4  # storage of the unquantized base (model.dtype)
    largest_quantized: int = 0  # elements of the largest quantized weight (dequantized whole for its matmul)
    head_trained: bool = False  # the output head trains too (peft.modules_to_save): the loss computes its gradient

    def quantized_bytes(self) -> float:
        if not self.quantized:
            return 0.0
        if self.bits == 8:  # LLM.int8(): int8 weights and one fp32 scale per row, ~negligible
            return self.quantized * 1.0
        constants = (8 / 64 + 32 / (64 * 256)) / 8 if self.double_quant else 32 / 64 / 8
        return self.quantized * (self.bits / 8 + constants)


def adapter_shape(model, peft, base_bytes: int = 4, task: str = "causal-lm", exclude: str | None = None
                  ) -> AdapterShape:
    """PEFT applied to `model` (on the meta device): the trainable count, and what qlora quantizes
    (every linear layer but the output head, as Transformers' bitsandbytes integration does); `exclude`:
    module names PEFT leaves out (a vision-language model's frozen parts)."""
    import torch
    from peft import get_peft_model

    from overdrive.hf.lora import lora_config

    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not out]
    quantized = sum(linear) if peft.method == "qlora" else 0
    config = lora_config(peft, task)
    config.exclude_modules = exclude
    import warnings

    with warnings.catch_warnings():  # PEFT asks a deprecated Transformers property on the way
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = get_peft_model(model, config)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    head = wrapped.get_output_embeddings() if hasattr(wrapped, "get_output_embeddings") else None
    head_trained = any(p.requires_grad for p in head.parameters()) if head is not None else False
    return AdapterShape(peft.method, trainable, quantized, peft.bits, peft.double_quant, base_bytes,
                        max(linear, default=0) if quantized else 0, head_trained)


def _base_terms(row: Row, shape: ModelShape, a: AdapterShape, bytes_unquantized: int, fraction: float,
                where: str, target: str = "params_bytes") -> None:
    unquantized = shape.params - a.quantized
    row.add(target, f"frozen base, {_dtype(bytes_unquantized)}{where} (no gradients, no optimizer state)",
            bytes_unquantized * unquantized * fraction)
    if a.quantized:
        kind = "NF4/FP4" if a.bits == 4 else "int8"
        row.add(target, f"frozen base linear weights, {a.bits}-bit {kind} with constants{where}",
                a.quantized_bytes() * fraction)


@dataclass(frozen=True)
class _Holding:
    """How an estimator row (formulas.STRATEGIES) holds a run: the ZeRO stage (0: not
    DeepSpeed), whether FSDP2 shards it, and what it offloads to the host."""
    label: str
    zero_stage: int = 0
    fsdp: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False


_HOLDS = {
    "ddp": _Holding("DDP"),
    "zero1": _Holding("ZeRO-1", 1),
    "zero2": _Holding("ZeRO-2", 2),
    "zero3": _Holding("ZeRO-3", 3),
    "fsdp2": _Holding("FSDP2", fsdp=True),
    "zero2_offload": _Holding("zero2_offload", 2, offload_optimizer=True),
    "zero3_offload_optimizer": _Holding("zero3_offload_optimizer", 3, offload_optimizer=True),
    "zero3_offload": _Holding("zero3_offload", 3, offload_optimizer=True, offload_params=True),
    "fsdp2_offload": _Holding("fsdp2_offload", fsdp=True, offload_optimizer=True, offload_params=True),
}


def model_state_row(strategy: str, shape: ModelShape, setup: Setup, a: AdapterShape) -> Row:
    """The strategy's row for an adapter run (activations are added by the caller as for any run)."""
    n, e, A = setup.devices, setup.half_bytes, a.trainable
    # The run's optimizer keeps its state for the trained parameters only (Adam: two fp32 moments).
    state, words = setup.optimizer_state_bytes(shape), setup.optimizer_words()
    how = _HOLDS[strategy]
    offload_opt, offload_params = how.offload_optimizer, how.offload_params
    row = Row(strategy, how.label + f" + {a.method}")
    opt = "host" if offload_opt else "optimizer_bytes"
    if not how.zero_stage:  # DDP or FSDP2
        sharded = how.fsdp
        part = 1 / n if sharded else 1
        where = " shards" if sharded else ""
        _base_terms(row, shape, a, a.base_bytes, part, where, "host" if offload_params else "params_bytes")
        row.add("host" if offload_params else "params_bytes", f"adapter weights, fp32{where}", 4 * A * part)
        row.add("host" if offload_opt else "grads_bytes", f"adapter gradients, fp32{where}", 4 * A * part)
        row.add(opt, f"{words} on the adapter{where}", state * A * part)
        if sharded:
            c = e
            row.add("buffers_bytes", "root unit gathered (embeddings, final norm, head)", c * shape.root_params)
            row.add("buffers_bytes", "two blocks gathered (current + prefetched)", 2 * c * shape.block_params)
            row.add("buffers_bytes", "one block's adapter gradients, before reduce-scatter", c * A / max(shape.layers, 1))
        elif setup.mixed and not a.quantized and a.base_bytes == 4:
            row.add("buffers_bytes", "autocast's 16-bit copies of the frozen weights, kept for backward",
                    2 * shape.autocast_params)
        if a.quantized:
            row.add("buffers_bytes", "one weight dequantized for its matmul (transient)", e * a.largest_quantized)
        return row
    # DeepSpeed casts the module to the 16-bit dtype; only trained parameters enter the optimizer.
    stage = how.zero_stage
    part = 1 / n if stage == 3 else 1
    where = " partition" if stage == 3 else ", whole on every rank"
    _base_terms(row, shape, a, e, part, where, "host" if offload_params else "params_bytes")
    row.add("host" if offload_params else "params_bytes", f"adapter weights, {_dtype(e)}{where}", e * A * part)
    row.add("host" if offload_opt else "master_weights_bytes", "fp32 master partition of the adapter", MASTER_BYTES * A / n)
    row.add(opt, f"{words} on the adapter partition", state * A / n)
    grads = e * A if stage == 1 else e * A / n
    row.add("host" if offload_opt else "grads_bytes", f"{_dtype(e)} adapter gradients"
            + (" (whole until the reduce)" if stage == 1 else " partition"), grads)
    if not offload_opt:
        row.add("grads_bytes", "fp32 adapter gradient partition built for step()", MASTER_BYTES * A / n)
    reduce, prefetch, _ = setup.buckets(shape.hidden)
    row.add("buffers_bytes", "reduce bucket (at most the adapter)", e * min(reduce, A))
    if stage == 3:
        row.add("buffers_bytes", "gathered parameters: the largest module's, whole", e * shape.largest_module_params)
        row.add("buffers_bytes", "prefetched parameters (stage3_prefetch_bucket_size)", e * prefetch)
    return row


def describe(a: Any) -> str:
    return (f"{a.method}: {a.trainable:,} trained parameters" +
            (f", {a.quantized:,} base weights in {a.bits} bit" if a.quantized else ""))
