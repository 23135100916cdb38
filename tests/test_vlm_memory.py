"""The estimate of a vision-language run against what a tiny model of each family really holds, on CPU
(docs/vision.md, "Memory"): the frozen vision tower and projector as weights only, the image tokens inside the
row's length.

Measured as tests/test_memory_activations.py measures: the activations are the storages autograd saves in the
forward of one real batch (images and all) plus what the forward leaves alive; the model states are the
parameters, their gradients and AdamW's state after one optimizer step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_memory_activations import forward_saved
from vlm_fixtures import make_tiny_models, make_tiny_qwen3_vl, make_vision_data


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-memory")
    make_tiny_models(root)
    make_tiny_qwen3_vl(root / "qwen3")
    make_vision_data(root, rows=8, layout="messages")
    return root


def settled(work: Path, name: str, *items: str):
    from overdrive.resolving.resolve import resolve

    return resolve([], cli=[f"model.name_or_path={work / name}", f"data.source={work / 'messages.jsonl'}",
                            "data.format=chat", "data.max_length=64", "launch.use_cpu=true",
                            "precision.mixed_precision=no", "data.validation_fraction=0", *items],
                   env={}, accelerate_default=False).config


def batch_of(cfg, rows: int) -> dict:
    from overdrive.training.build.vision import prepare, settle

    _, model_type = settle(cfg)
    processor, splits, collate = prepare(cfg, model_type)
    return collate([splits.train[i] for i in range(rows)])


def measured(model, batch: dict) -> tuple[int, int]:
    """(activations, model states) in bytes."""
    activations, out = forward_saved(model, batch)
    out.loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    optimizer.step()
    states = sum(p.numel() * p.element_size() for p in model.parameters())
    # A trained parameter the forward never reaches (CLIP's post_layernorm, when LLaVA reads the last layer's
    # features) gets no gradient and no optimizer state; the estimate counts it as trained.
    states += sum(p.grad.numel() * p.grad.element_size() for p in trained if p.grad is not None)
    states += sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                  if k != "step")  # AdamW's step counters: a scalar per tensor, not in the estimate
    return activations, states


@pytest.mark.slow
@pytest.mark.parametrize("name,items", [("qwen", ()), ("llava", ()), ("qwen", ("model.vision.train_projector=true",)),
                                        ("llava", ("model.vision.freeze=false",)), ("qwen3", ())],
                         ids=["qwen2-vl", "llava", "qwen2-vl-projector-trained", "llava-tower-trained", "qwen3-vl"])
def test_the_estimate_of_a_vlm_run_matches_what_it_holds(work, name, items):
    from overdrive.memory import estimate_row
    from overdrive.memory.model_shape import run_shape
    from overdrive.memory.shape import setup_for_run
    from overdrive.training.build.model import build_model

    cfg = settled(work, name, "training.micro_batch_size=4", *items)
    batch = batch_of(cfg, 4)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    activations, states = measured(model, batch)
    setup = setup_for_run(cfg, "cpu", micro_batch=4, seq_len=batch["input_ids"].shape[1], precision="no")
    assert setup.image_tokens == {"qwen": 4, "llava": 5, "qwen3": 4}[name]
    assert setup.frozen_parts == {(): ("vision", "projector"), ("model.vision.freeze=false",): ("projector",)}.get(
        items, ("vision",))
    row = estimate_row("ddp", run_shape(cfg), setup)
    predicted_states = row.params_bytes + row.grads_bytes + row.optimizer_bytes
    print(f"{name}{items}: states predicted {predicted_states:,} measured {states:,}; activations predicted "
          f"{row.activations_saved_bytes:,} measured {activations:,}")
    assert abs(predicted_states / states - 1) < 0.01  # frozen parts: weights only, counted tensor by tensor
    assert abs(row.activations_saved_bytes / activations - 1) < 0.1


def test_frozen_parts_are_weights_only_in_every_strategy():
    """Hand-made shape: 1,000 language parameters train; 600 of vision and 400 of projector are frozen."""
    from overdrive.memory import estimate_row
    from overdrive.memory.shape import ModelShape, Setup

    shape = ModelShape(name="vlm", model_type="qwen2_vl", params=2000, param_shapes=((10, 100), (6, 100), (4, 100)),
                       layers=1, hidden=100, heads=1, kv_heads=1, intermediate=100, vocab=10, block_params=1000,
                       root_params=1000, largest_module_params=1000, autocast_params=2000,
                       parts=("language", "vision", "projector"), vision_hidden=8, vision_layers=1)
    setup = Setup(devices=2, precision="no", micro_batch=1, seq_len=4, target="cpu",
                  frozen_parts=("vision", "projector"), image_tokens=2, image_patches=8)
    ddp, fsdp2, zero3 = (estimate_row(s, shape, setup) for s in ("ddp", "fsdp2", "zero3"))
    assert ddp.grads_bytes == 4 * 1000 and ddp.optimizer_bytes == 8 * 1000 and ddp.params_bytes == 4 * 2000
    assert fsdp2.params_bytes == 4 * 2000 // 2 and fsdp2.grads_bytes == 4 * 1000 // 2
    frozen = [b for f, what, b in zero3.terms if "frozen vision and projector" in what]
    assert frozen == [4 * 1000 // 2]  # fp32 here (no mixed precision), partitioned over 2 ranks
    trained = estimate_row("ddp", shape, Setup(devices=1, precision="no", micro_batch=1, seq_len=4, target="cpu",
                                               frozen_parts=("projector",), image_patches=8))
    assert trained.grads_bytes == 4 * 1600 and trained.activations_saved_bytes > ddp.activations_saved_bytes
