"""The generation phase the online objectives share: the policy samples continuations of token-id
prompts, with a seed of the caller's, leaving the training RNG stream as it was.

    seeded(accelerator, seed)         the context sampling runs in: the RNG forked and seeded, the
                                      run's autocast on
    sample(model, accelerator, inputs, max_new_tokens, ...)
                                      one continuation per input (left-padded where they differ),
                                      each cut after its first end-of-sequence token (TRL's)

GRPO (training/objectives/grpo.py) samples each group of completions through it, on-policy distillation
(training/objectives/distill_policy.py) each micro-batch's prompts. A seed that is a function of the run's seed
and the step's or group's number is what makes a resumed run draw the same samples.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch


def mixed_seed(seed: int, number: int) -> int:
    """A sampling seed that is a function of the run's seed and one number (a group, a step) alone."""
    return (seed * 1_000_003 + number) % (2 ** 63 - 1)


@contextlib.contextmanager
def seeded(accelerator: Any, seed: int) -> Iterator[None]:
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), accelerator.autocast():  # the training RNG stream is left as it was
        torch.manual_seed(seed)
        yield


def left_padded(rows: list[list[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of prompts of different lengths, padded on the left (generation's side)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@contextlib.contextmanager
def root_unsharded(model: Any) -> Iterator[None]:
    """FSDP2: the root unit's own parameters gathered while the model generates. Transformers' generate encodes
    a vision-language prompt's images (its multimodal encoder step) before the model's forward, so the root's
    forward hook, which gathers them, has not run when the vision tower's patch embedding (a root parameter)
    is called; the blocks wrapped as units of their own gather themselves as they run. ZeRO-3 gathers each
    module's parameters in that module's own hook, wherever it is called from."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    # The root is chosen by the first forward; a run that generates before its first training forward would
    # otherwise make the vision tower's first block the root, which the model's own forward then refuses.
    model._get_fsdp_state()._lazy_init()
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def sample(model: Any, accelerator: Any, inputs: list[list[int]], max_new_tokens: int, *, pad_id: int,
           eos_id: Optional[int], temperature: float, top_p: float = 1.0, top_k: Optional[int] = 0,
           synced: bool = False, inputs_for: Optional[Callable[[int], dict]] = None) -> list[list[int]]:
    """A continuation of the policy after each input, cut after its end-of-sequence token. `synced`:
    every rank takes every forward (a sharded model, ZeRO-3 or FSDP2, over several processes);
    `inputs_for(prompt width)`: the model's further inputs (a vision-language policy's images)."""
    ids, mask = left_padded(inputs, pad_id, accelerator.device)
    more = inputs_for(ids.shape[1]) if inputs_for is not None else {}
    policy = accelerator.unwrap_model(model)
    with root_unsharded(policy) if more else contextlib.nullcontext():
        out = policy.generate(
            input_ids=ids, attention_mask=mask, **more, do_sample=True, temperature=temperature, top_p=top_p,
            top_k=top_k, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
            synced_gpus=synced and accelerator.num_processes > 1)
    completions = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t == eos_id), len(row))
        completions.append(row[:cut])
    return completions
