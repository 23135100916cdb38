"""The estimate of every strategy's memory per device for one model shape and setup, and whether an
error message means out of memory."""

from __future__ import annotations

from dataclasses import dataclass

from overdrive.memory.activations import Activations, estimate_activations
from overdrive.memory.adapter import model_state_row as adapter_row
from overdrive.memory.formulas import STRATEGIES, Row, model_state_row, uses_autocast
from overdrive.memory.formulas import zero_paper_bytes  # noqa: F401  (handed on by the package)
from overdrive.memory.shape import (ModelShape, Setup, dense_and_held_experts, ep_slice, fsdp2_shard_numel, numel,
                                    tp_slice, trained_and_frozen, zero3_partition_numel)


# How running out of memory reads in an error or a log: CUDA's and torch's messages, the
# CPU allocator's, glibc's "Cannot allocate memory", and cuBLAS/cuDNN, which report a failed
# workspace allocation as a status rather than as torch's OutOfMemoryError.
OOM_MARKS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory",
             "defaultcpuallocator", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def mentions_out_of_memory(text: str) -> bool:
    lowered = text.lower()
    return any(mark in lowered for mark in OOM_MARKS)


@dataclass
class Estimate:
    shape: ModelShape
    setup: Setup
    rows: list[Row]

    def row(self, strategy: str) -> Row:
        return next(r for r in self.rows if r.strategy == strategy)


def estimate_row(strategy: str, shape: ModelShape, setup: Setup) -> Row:
    """Model states, buffers and activations of one strategy (of one tensor-parallel slice)."""
    sliced = tp_slice(shape, setup.tp)
    if strategy == "ddp":  # parameters whole on every rank: expert parallel keeps experts / ep of them
        sliced = ep_slice(sliced, setup.ep)
    # A vision-language model's frozen parts: weights only. An adapter run counts its frozen base whole already.
    sliced, frozen = trained_and_frozen(sliced, setup.frozen_parts if setup.adapter is None else ())
    if strategy.startswith("fsdp2") and setup.ep > 1 and sliced.experts and setup.adapter is None:
        row = _fsdp2_beside_experts(strategy, sliced, setup)
    elif setup.adapter is None:
        row = model_state_row(strategy, sliced, setup)
    else:  # LoRA/QLoRA: gradients and optimizer states for the adapter only (adapter.py)
        row = adapter_row(strategy, sliced, setup, setup.adapter)
    if frozen:
        _add_frozen_parts(row, strategy, frozen, setup)
    if setup.reference_copy and setup.adapter is None:  # the weights as they are loaded, unsharded, no gradients
        why = "rl.beta" if setup.generation_tokens else "preference.method"
        row.add("params_bytes", f"reference model: a frozen copy of the weights ({why})", 4 * sliced.params)
    if setup.teacher_params:  # in the student's dtype; sharded as the student is (strategies/frozen.py)
        sharded = strategy.startswith(("zero3", "fsdp2"))
        ranks = setup.shard_ranks if sharded else 1  # HSDP: over one replica's ranks, as the student
        row.add("params_bytes", f"teacher: {setup.teacher_params:,} frozen parameters (distill.teacher)"
                + (f", sharded over {ranks} ranks" if sharded else ", whole on every rank"),
                setup.teacher_params * setup.teacher_bytes // ranks)
    if setup.generation_tokens:  # keys and values of every layer for a rank's step's sequences (counted on top:
        # the generation's peak and the update's are not at once, so this is an upper bound)
        kv_heads = max(sliced.kv_heads, 1)
        row.add("buffers_bytes", f"generation: KV cache of a rank's step ({setup.generation_tokens:,} tokens, rl.*)",
                2 * sliced.layers * kv_heads * (sliced.hidden // max(sliced.heads, 1)) * setup.generation_tokens
                * setup.half_bytes)
    act: Activations = estimate_activations(shape, setup, uses_autocast(strategy, setup))
    row.activations_full_bytes = act.peak
    row.activations_checkpointed_bytes = act.peak_checkpointed
    row.activations_saved_bytes = act.saved_checkpointed if setup.checkpointing else act.saved
    kept = act.resident_layers
    offloaded = act.layers - kept
    if setup.checkpointing:
        row.add("activations_bytes", "layer inputs kept by checkpointing", kept * act.layer_input)
        row.add("activations_bytes", "one layer recomputed in backward", act.layer)
        if offloaded:
            row.add("host", "layer inputs offloaded to host (training.activation_offloading)", offloaded * act.layer_input)
    else:
        row.add("activations_bytes", f"{kept} layers' saved tensors ({act.kernel} attention)", kept * act.layer)
        if offloaded:
            row.add("host", "layers' saved tensors offloaded to host (training.activation_offloading)",
                    offloaded * act.layer)
    row.add("activations_bytes", "embedding dropout mask, position ids", act.embeddings)
    _add_loss_terms(row, act, setup.loss_kernel)
    if setup.image_patches and "vision" not in setup.frozen_parts and setup.adapter is None:
        row.add("activations_bytes", f"vision tower: {setup.image_patches:,} patches of one image a row, "
                f"{shape.vision_layers} blocks (model.vision.freeze off)", act.vision)
    return row


def _add_frozen_parts(row: Row, strategy: str, frozen: tuple, setup: Setup) -> None:
    """A vision-language model's frozen vision tower and projector: weights as the strategy holds them, no
    gradients, no optimizer state (they are in no optimizer group). DDP and FSDP2 keep the loaded fp32 weights
    (FSDP2 sharded per tensor); DeepSpeed casts them to the 16-bit dtype (ZeRO-3 partitioned)."""
    n, e = setup.shard_ranks, setup.half_bytes
    if strategy.startswith("fsdp2"):
        nbytes, where = 4 * sum(fsdp2_shard_numel(s, n) for s in frozen), "fp32 shards"
    elif strategy.startswith("zero3"):
        nbytes, where = e * sum(zero3_partition_numel(s, n) for s in frozen), "partitions"
    elif strategy.startswith("zero"):
        nbytes, where = e * sum(numel(s) for s in frozen), "whole on every rank"
    else:
        nbytes, where = 4 * sum(numel(s) for s in frozen), "fp32, whole"
    target = "host" if strategy in ("zero3_offload", "fsdp2_offload") else "params_bytes"
    row.add(target, f"frozen {' and '.join(setup.frozen_parts)} ({sum(numel(s) for s in frozen):,} parameters, "
            f"{where}; model.vision.*): no gradients, no optimizer state", nbytes)


def _fsdp2_beside_experts(strategy: str, shape: ModelShape, setup: Setup) -> Row:
    """Expert parallel x FSDP2 (strategies/expert_parallel.py): FSDP2's row for the dense weights,
    and the experts / ep this rank holds whole, with their gradients and optimizer states (FSDP2
    leaves them to expert parallel)."""
    dense, experts = dense_and_held_experts(shape, setup.ep)
    row = model_state_row(strategy, dense, setup)
    for target, what, nbytes in model_state_row("ddp", experts, setup).terms:
        if target in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            row.add(target, f"routed experts, 1/{setup.ep} of them held whole (expert parallel): {what}", nbytes)
    return row


def _add_loss_terms(row: Row, act: Activations, kernel: str) -> None:
    """The output layer's terms, named for the loss kernel that runs (training.loss_kernel)."""
    if kernel == "full":
        row.add("activations_bytes", "final norm, LM-head input, fp32 log-softmax, labels", act.head)
        if act.logits_held:
            row.add("activations_bytes", "logits held until backward", act.logits)
        row.add("activations_bytes", "fp32 loss gradients at the start of backward", act.loss_backward)
    elif kernel == "chunked":
        row.add("activations_bytes", "final norm, LM-head input, labels (no logits: chunked loss)", act.head)
        row.add("activations_bytes", "one slice's logits and log-softmax, the hidden states' gradient (chunked loss)",
                act.loss_backward)
    else:
        row.add("activations_bytes", "final norm, LM-head input, labels, gradients computed in forward (fused loss)",
                act.head)
        row.add("activations_bytes", "one chunk's fp32 logits and their gradient (fused loss)", act.loss_backward)


def estimate(shape: ModelShape, setup: Setup, strategies: tuple[str, ...] = STRATEGIES) -> Estimate:
    if setup.devices < 1 or setup.micro_batch < 1 or setup.seq_len < 1:
        raise ValueError("devices, micro_batch and seq_len must be positive")
    return Estimate(shape, setup, [estimate_row(name, shape, setup) for name in strategies])
