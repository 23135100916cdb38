"""The generation phase the online objectives share: the policy samples continuations of token-id
prompts, each from a random stream of its own, leaving the training RNG stream as it was.

    seeded(accelerator, seed)         the context sampling runs in: the RNG forked and seeded, the
                                      run's autocast on
    sample(model, accelerator, inputs, max_new_tokens, ..., seeds=...)
                                      one continuation per input (left-padded where they differ),
                                      each cut after its first end-of-sequence token (TRL's)

How a token is drawn (Gumbel-max): the logits at the temperature, filtered by top-k and top-p as
Transformers filters them, plus Gumbel noise from the completion's own generator (seeded by its
seed, advanced one draw per token); the argmax is a sample of the filtered softmax. So a completion
depends on its prompt, its seed and the weights alone, never on which other completions share its
batch: GRPO generates a rank's whole step in one batched call and still draws what one process, two
processes, a halved split or a resumed run draw.

The decoding loop is our own over Transformers' DynamicCache (one forward per token, last position
only, no generate() bookkeeping: on this project's CPU, one thread, 32 completions of a 2-layer Llama took
0.093 s for 24 tokens against generate's 0.112 s with the same draw, 0.012 s against 0.023 s for 8
greedy tokens); a model that needs more than that (a vision-language policy's image inputs, a cache of
its own) goes through `generate` with the same draw as its logits processor. At temperature 0 it is
greedy decoding. GRPO (training/objectives/grpo.py) and
on-policy distillation (training/objectives/distill_policy.py) sample through here.
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


class GumbelDraw:
    """Scores whose argmax is each row's sample: the logits at `temperature`, top-k and top-p filtered
    (Transformers' warpers, row by row as generate filters), plus Gumbel noise from the row's own
    generator. A Transformers logits processor too (`generate` then decodes greedily)."""

    def __init__(self, seeds: list[int], device: Any, temperature: float, top_p: float = 1.0,
                 top_k: Optional[int] = 0):
        from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.filters = ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])

    def __call__(self, input_ids: Optional[torch.Tensor], scores: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0.0:  # greedy: the argmax as it is
            return scores.float()
        scores = scores.float() / self.temperature
        for f in self.filters:
            scores = f(input_ids, scores)
        width = scores.shape[-1]
        uniform = torch.stack([torch.rand(width, generator=g, device=g.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))
        return scores + gumbel.to(scores.device)


def lean_decoding(model: Any) -> bool:
    """Whether our own loop over a DynamicCache decodes `model` (Transformers' default cache for it)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    config = getattr(model, "config", None)
    return callable(supports) and supports() and config is not None and not getattr(config, "is_encoder_decoder", False)


def any_rank_busy(busy: bool, device: Any) -> bool:
    """Whether this rank or another is still busy (an all-reduce every rank takes at the same point)."""
    flag = torch.tensor([1.0 if busy else 0.0], device=device)
    torch.distributed.all_reduce(flag)
    return flag.item() > 0


@torch.no_grad()
def decode(model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, draw: GumbelDraw, *,
           eos_id: Optional[int], pad_id: int, synced: bool = False) -> torch.Tensor:
    """[B, ≤ max_new_tokens] new tokens after left-padded `ids`, one forward per token over a DynamicCache;
    a row is `pad_id` after its end-of-sequence. `synced`: this rank forwards until every rank is done
    (a sharded model gathers its weights in every forward, so every rank takes each)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    new, step_ids = [], ids
    for step in range(max_new_tokens if not synced else 1 << 30):
        busy = step < max_new_tokens and not bool(done.all())
        if synced and not any_rank_busy(busy, ids.device):
            break
        if not busy and not synced:
            break
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True, logits_to_keep=1)
        if not busy:  # this rank is done: the forward only keeps the others' gathers company
            token = torch.full_like(done, pad_id, dtype=torch.long)
        else:
            token = draw(None, out.logits[:, -1, :]).argmax(-1)
            token = token.masked_fill(done, pad_id)
            new.append(token)
            if eos_id is not None:
                done |= token == eos_id
        step_ids = token[:, None]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        positions = positions[:, -1:] + 1
    return torch.stack(new, dim=1) if new else ids.new_zeros((ids.shape[0], 0))


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
           synced: bool = False, inputs_for: Optional[Callable[[int], dict]] = None,
           seeds: Optional[list[int]] = None, continuous_batching: bool = False) -> list[list[int]]:
    """A continuation of the policy after each input, cut after its end-of-sequence token. `seeds`: each
    input's own sampling seed (drawn from torch's stream, as `seeded` set it, where not given); temperature
    0: greedy. `synced`: every rank takes every forward (a sharded model, ZeRO-3 or FSDP2, over several
    processes); `inputs_for(prompt width)`: the model's further inputs (a vision-language policy's images).
    `continuous_batching`: Transformers' `generate_batch` (paged attention) samples instead, from torch's
    stream: its draws depend on the batch, not on `seeds`."""
    if not inputs:
        return []
    if continuous_batching:
        return _continuous_batched(accelerator.unwrap_model(model), inputs, max_new_tokens, pad_id, eos_id,
                                   temperature, top_p, top_k)
    if seeds is None:
        seeds = torch.randint(0, 2 ** 62, (len(inputs),)).tolist()
    ids, mask = left_padded(inputs, pad_id, accelerator.device)
    policy = accelerator.unwrap_model(model)
    draw = GumbelDraw(seeds, accelerator.device, temperature, top_p, top_k)
    synced = synced and accelerator.num_processes > 1
    if inputs_for is None and lean_decoding(policy):
        new = decode(policy, ids, mask, max_new_tokens, draw, eos_id=eos_id, pad_id=pad_id, synced=synced)
    else:
        more = inputs_for(ids.shape[1]) if inputs_for is not None else {}
        with root_unsharded(policy) if more else contextlib.nullcontext():
            out = policy.generate(input_ids=ids, attention_mask=mask, **more, do_sample=False,
                                  logits_processor=[draw], max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                                  eos_token_id=eos_id, synced_gpus=synced, temperature=None, top_p=None, top_k=None)
        new = out[:, ids.shape[1]:]
    completions = []
    for row in new.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t == eos_id), len(row))
        completions.append(row[:cut])
    return completions


def _continuous_batched(model: Any, inputs: list[list[int]], max_new_tokens: int, pad_id: int, eos_id: Optional[int],
                        temperature: float, top_p: float, top_k: Optional[int]) -> list[list[int]]:
    """Transformers' continuous batching (`generate_batch`, as TRL's use_transformers_continuous_batching): the
    completions in the order of `inputs`, each cut after its end-of-sequence token."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=temperature > 0.0, temperature=temperature or None, top_p=top_p,
                              top_k=top_k or None, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_id)
    outputs = list(model.generate_batch(inputs, generation_config=config, progress_bar=False).values())  # inputs' order
    if len(outputs) != len(inputs) or any(o.error is not None for o in outputs):
        raise RuntimeError(f"continuous batching returned {len(outputs)} of {len(inputs)} completions (its log says why)")
    completions = []
    for request in outputs:
        row = list(request.generated_tokens)
        cut = next((i + 1 for i, t in enumerate(row) if t == eos_id), len(row))
        completions.append(row[:cut])
    return completions
