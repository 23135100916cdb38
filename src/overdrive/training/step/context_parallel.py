"""Context parallel in the loop: each rank of a cp group takes its slice of every sequence.

Accelerate's ParallelismConfig(cp_size > 1) only prepares the model (its hooks make every
attention causal and drop `attention_mask`); the loop must still shard the sequence buffers
around forward and backward with `accelerator.maybe_context_parallel`, as Accelerate's
nd_parallel example does:

    buffers = [input_ids, shift_labels, labels, position_ids]   # sequence dim 1 each
    with accelerator.maybe_context_parallel(buffers, [1] * 4, no_restore_buffers=set(buffers)):
        loss = model(**batch).loss; accelerator.backward(loss)

`shift_labels` is computed before sharding: after it, a rank's last position would predict the
first token of the next rank's slice, which the model's own shift cannot see. `labels` stays in
the batch only because Transformers computes a loss when it is given (shift_labels wins).

Masks are dropped by the hooks, so what relies on one (packed conversations, classification's
padding) is refused before a run starts (resolving/composition.py); right padding of a causal
LM needs none (no real token attends to a later pad).
"""

from __future__ import annotations

import contextlib
from typing import Any

from overdrive.config.schema import RunConfig


def cp_size(cfg: RunConfig) -> int:
    from overdrive.strategies import layout

    return layout.layout(cfg).cp


def with_sequence_buffers(micro_batch: dict) -> tuple[dict, list]:
    """The micro-batch with `shift_labels` and `position_ids` added and the mask dropped, and
    the buffers to shard, in the order Accelerate's example passes them."""
    import torch

    from overdrive.training.step.step_loss import shifted_labels

    batch = dict(micro_batch)
    ids = batch["input_ids"]
    labels = batch.get("labels")
    if labels is None:
        labels = batch["labels"] = ids.clone()
    batch["shift_labels"] = shifted_labels(labels).contiguous()
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(ids.size(1), device=ids.device).unsqueeze(0).expand_as(ids).contiguous()
    batch.pop("attention_mask", None)  # the CP hooks set it to None and make attention causal
    return batch, [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]


def sharding(accelerator: Any, cfg: RunConfig, micro_batch: dict) -> tuple[dict, Any]:
    """(the batch the model is called with, the context forward and backward run in): the
    sequence buffers sharded over the cp group when cp_size > 1, else the batch as it is."""
    if cp_size(cfg) <= 1:
        return micro_batch, contextlib.nullcontext()
    batch, buffers = with_sequence_buffers(micro_batch)
    return batch, accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                     no_restore_buffers=set(buffers))
