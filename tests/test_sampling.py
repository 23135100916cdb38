"""The policy's sampler (training/generation/sampling.py): each completion drawn from its own seed, whatever
else shares its batch; greedy at a temperature near 0; the filtered softmax's distribution; our decoding loop
and Transformers' generate draw the same."""

from __future__ import annotations


import pytest
import torch

from overdrive.training.generation import sampling
from hf_fixtures import OneProcessAccelerator

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3]]


@pytest.fixture(scope="module")
def policy(llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama).eval()


def _sample(model, prompts, seeds, new=10, **kw):
    kw.setdefault("temperature", 1.0)
    return sampling.sample(model, OneProcessAccelerator(), prompts, new, pad_id=0, eos_id=2, seeds=seeds, **kw)


def test_a_completion_is_the_same_alone_and_in_any_batch(policy):
    together = _sample(policy, PROMPTS, [11, 12, 13, 14])
    assert _sample(policy, PROMPTS[2:3], [13]) == together[2:3]
    assert _sample(policy, PROMPTS[::-1], [14, 13, 12, 11]) == together[::-1]
    assert _sample(policy, PROMPTS, [11, 99, 13, 14])[1] != together[1]  # its own seed decides


def test_near_zero_temperature_is_transformers_greedy_decoding(policy):
    ids, mask = sampling.left_padded(PROMPTS, 0, "cpu")
    with torch.no_grad():
        greedy = policy.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0,
                                 eos_token_id=2)[:, ids.shape[1]:].tolist()
    mine = _sample(policy, PROMPTS, [1, 2, 3, 4], temperature=1e-5)
    assert mine == [row[:len(m)] for row, m in zip(greedy, mine)]


def test_our_decoding_and_generate_draw_the_same(policy):
    ids, mask = sampling.left_padded(PROMPTS, 0, "cpu")
    draw = sampling.GumbelDraw([7, 8, 9, 10], "cpu", 0.7, top_p=0.9, top_k=8)
    with torch.no_grad():
        theirs = policy.generate(input_ids=ids, attention_mask=mask, do_sample=False, logits_processor=[draw],
                                 max_new_tokens=10, pad_token_id=0, eos_token_id=2)[:, ids.shape[1]:].tolist()
    mine = _sample(policy, PROMPTS, [7, 8, 9, 10], temperature=0.7, top_p=0.9, top_k=8)
    assert mine == [row[:len(m)] for row, m in zip(theirs, mine)]


def test_the_draws_follow_the_filtered_softmax(policy):
    n, prompt = 2000, [5, 6, 7]
    with torch.no_grad():
        logits = policy(torch.tensor([prompt])).logits[0, -1] / 0.8
    kept = logits.topk(5).indices
    probs = torch.full_like(logits, float("-inf")).scatter(0, kept, logits[kept]).softmax(-1)
    firsts = [c[0] for c in _sample(policy, [prompt] * n, list(range(n)), new=1, temperature=0.8, top_k=5)]
    counts = torch.bincount(torch.tensor(firsts), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0  # never outside the top 5
    # each kept token's frequency within 4 standard errors of its probability
    error = (probs * (1 - probs) / n).sqrt().double()
    assert ((counts / n - probs.double()).abs() <= 4 * error + 1e-9).all()


@pytest.mark.slow  # Transformers' continuous batching takes 15-35 s on this CPU (a GPU path: refused on CPU)
def test_continuous_batching_at_temperature_0_gives_generates_completions(policy):
    ids, mask = sampling.left_padded(PROMPTS, 0, "cpu")
    with torch.no_grad():
        greedy = policy.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0,
                                 eos_token_id=2)[:, ids.shape[1]:].tolist()
    batched = _sample(policy, PROMPTS, None, new=6, temperature=0.0, continuous_batching=True)
    assert batched == [row[:len(b)] for row, b in zip(greedy, batched)] and all(batched)
    assert _sample(policy, PROMPTS, [1, 2, 3, 4], new=6, temperature=0.0) == batched  # and the default sampler's
