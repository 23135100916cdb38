"""`data.document_mask`: documents packed into one block keep apart (position ids restart after each
EOS, the first token after an EOS is not predicted), so each token's loss is its document's alone."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from overdrive.data.samples import PackedBlocks, document_positions

EOS = 2


def test_positions_restart_after_each_eos_and_the_next_token_is_not_predicted():
    ids = torch.tensor([5, 6, EOS, 7, 8, 9, EOS, 4])
    got = document_positions(ids, EOS)
    assert got["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert got["labels"].tolist() == [5, 6, EOS, -100, 8, 9, EOS, -100]


def test_packed_blocks_carry_them_and_keep_them_through_a_pickle():
    tokens = np.array([5, 6, EOS, 7, 8, 9, EOS, 4, 3, 3], dtype=np.uint16)
    blocks = PackedBlocks(tokens, 5, document_end=EOS)
    again = pickle.loads(pickle.dumps(blocks))
    assert again[1]["position_ids"].tolist() == [0, 1, 0, 1, 2]
    assert again[1]["labels"].tolist() == [9, EOS, -100, 3, 3]
    plain = PackedBlocks(tokens, 5)[1]
    assert set(plain) == {"input_ids", "labels"} and plain["labels"].tolist() == [9, EOS, 4, 3, 3]


def _token_losses(model, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Per-token cross entropy, position t predicting label t+1 (the model's shift); -100 gives 0."""
    extra = {} if positions is None else {"position_ids": positions[None]}
    logits = model(input_ids=ids[None], **extra).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="none")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_three_packed_documents_each_give_the_losses_they_have_alone(attention):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # use_cache=False as every training config has it (hf/model_config.py): with a cache, Transformers
    # does not look for packed sequences in the position ids.
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                         max_position_embeddings=64, eos_token_id=EOS, tie_word_embeddings=False, use_cache=False,
                                         attn_implementation=attention)).eval()
    documents = [torch.tensor([7, 11, 13, 17, EOS]), torch.tensor([19, 23, 29, EOS]),
                 torch.tensor([31, 37, 41, 43, 47, 3, EOS])]
    block = torch.cat(documents)
    packed = document_positions(block, EOS)
    with torch.no_grad():
        together = _token_losses(model, block, packed["labels"], packed["position_ids"])
        unmasked = _token_losses(model, block, block, None)
        start = 0
        for i, doc in enumerate(documents):
            alone = _token_losses(model, doc, doc, None)
            # Position t's loss predicts token t+1: a document's losses sit at its positions but its last.
            mine = together[start:start + len(doc) - 1]
            assert torch.allclose(mine, alone, rtol=1e-5, atol=1e-6), (i, mine, alone)
            if i:
                assert together[start - 1] == 0  # the first token after an EOS: not predicted
                # Without the mask, the later documents see the earlier ones: the losses differ.
                assert not torch.allclose(unmasked[start:start + len(doc) - 1], alone, rtol=1e-3, atol=1e-4)
            start += len(doc)
