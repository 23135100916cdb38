"""Packing conversations with images (`data.packing` on a vision-language model, data/vision_packing.py): the
loss of packed rows equals the loss of the same conversations one per row, to 1e-5, for Qwen2-VL, Qwen2.5-VL,
Qwen3-VL (3-D rope positions by the model's get_rope_index per conversation; Qwen3-VL's deepstack features follow
its image tokens) and LLaVA (1-D positions restarting).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vlm_fixtures import make_tiny_llava, make_tiny_qwen2_vl, make_tiny_qwen3_vl, make_vision_data

from overdrive.data.vision_samples import IGNORE


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-packing")
    make_tiny_qwen2_vl(root / "qwen2_vl")
    make_tiny_qwen2_vl(root / "qwen2_5_vl", family="qwen2_5_vl")
    make_tiny_qwen3_vl(root / "qwen3_vl")
    make_tiny_llava(root / "llava")
    make_vision_data(root, rows=12, layout="messages")
    return root


def settled(work: Path, name: str, packing: bool):
    from overdrive.resolving.resolve import resolve

    return resolve([], cli=[f"model.name_or_path={work / name}", f"data.source={work / 'messages.jsonl'}",
                            "data.format=chat", "data.max_length=64", "launch.use_cpu=true",
                            "data.validation_fraction=0", f"data.packing={str(packing).lower()}"],
                   env={}, accelerate_default=False).config


def token_losses(model, batch: dict) -> torch.Tensor:
    """Each loss token's cross entropy, in order (the model shifts: token t predicted from those before it)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float()[:, :-1]
    labels = batch["labels"][:, 1:]
    kept = labels != IGNORE
    return torch.nn.functional.cross_entropy(logits[kept], labels[kept], reduction="none")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"])
def test_packed_rows_give_the_loss_of_one_conversation_a_row(work, name):
    from overdrive.training.build.model import build_model
    from overdrive.training.build.vision import prepare, settle

    losses, counts = {}, {}
    for packing in (False, True):
        cfg = settled(work, name, packing)
        _, splits, collate = prepare(cfg, settle(cfg)[1])
        rows = [splits.train[i] for i in range(len(splits.train))]
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        with torch.no_grad():
            losses[packing] = torch.cat([token_losses(model, collate(rows[i:i + 4])) for i in range(0, len(rows), 4)])
        counts[packing] = len(rows)
        if packing:
            batch = collate(rows[:2])
            assert "attention_mask" not in batch and batch["input_ids"].shape == (2, 64)
            positions = batch["position_ids"]
            assert positions.shape == ((4, 2, 64) if name != "llava" else (2, 64))
            text = positions[0] if name != "llava" else positions
            assert (text[0] == 0).sum() >= 3  # several conversations in the first row, each from position 0
    unpacked, packed = losses[False], losses[True]
    gap = (packed - unpacked).abs().max().item()  # the same tokens in the same order: compared one by one
    print(f"{name}: loss unpacked {unpacked.mean():.8f} over {counts[False]} rows, packed {packed.mean():.8f} over "
          f"{counts[True]} rows; largest gap of one token's loss {gap:.2e}")
    assert len(packed) == len(unpacked) and counts[True] < counts[False]
    assert abs(packed.mean() - unpacked.mean()) < 1e-5 and gap < 1e-5
