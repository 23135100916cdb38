"""DPO, SimPO and ORPO on pairs with images (docs/vision.md, "Preference pairs"): TRL's vision pairs (`images`, a prompt of turns
with an image part, `chosen`, `rejected`) on tiny Qwen2-VL and LLaVA models.

Quick: each side of a pair is prompt + answer with the prompt's images, its labels the answer's tokens alone; the
batch holds the chosen rows and then the rejected ones, each with its image. Slow: the image reaches both
forwards (the log-probs move when it changes), and a DPO run's step-1 loss is ln 2 (the policy equal to its
reference: LoRA's adapter disabled, or a full run's frozen copy); SimPO's and ORPO's step-1 losses are TRL's formulas
computed by hand from the base model's log-probs (ORPO's NLL without the image tokens).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from vlm_fixtures import make_vision_pairs, make_tiny_models

from overdrive.errors import UserError


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-pairs")
    make_tiny_models(root)
    make_vision_pairs(root, rows=8)
    return root


def settled(work: Path, name: str, *items: str):
    from overdrive.resolving.resolve import resolve
    from overdrive.training.build import user_inputs

    return resolve([], cli=[f"model.name_or_path={work / name}", f"data.source={work / 'pairs.jsonl'}",
                            "data.format=preference", "preference.method=dpo", "data.max_length=64",
                            "launch.use_cpu=true", "data.validation_fraction=0", *items],
                   env={}, accelerate_default=False, checks=user_inputs.check).config


def pair_batch(cfg, pairs: int) -> tuple[dict, object]:
    from overdrive.training.build.vision import prepare, settle

    processor, splits, collate = prepare(cfg, settle(cfg)[1])
    return collate([splits.train[i] for i in range(pairs)]), processor


@pytest.mark.slow
def test_a_pair_is_two_rows_with_the_prompts_images_and_only_the_answer_in_the_loss(work):
    from overdrive.data.vision_samples import IGNORE

    batch, processor = pair_batch(settled(work, "qwen"), 2)
    rows = json.loads((work / "pairs.jsonl").read_text().splitlines()[0])
    assert batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape[0] == 4  # chosen x2, rejected x2
    image = torch.isin(batch["input_ids"], torch.tensor(processor.image_token_ids))
    assert (image.sum(dim=1) >= 4).all()  # every row, chosen and rejected, carries its image
    answer = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][0][batch["labels"][0] != IGNORE].tolist())
    assert answer == rows["chosen"][0]["content"][0]["text"].split() + ["<|im_end|>"]
    rejected = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][2][batch["labels"][2] != IGNORE].tolist())
    assert rejected == rows["rejected"].split() + ["<|im_end|>"]
    bad = work / "bad-pairs.jsonl"
    row = {**rows, "rejected": [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]}
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError) as refused:
        settled(work, "qwen", f"data.source={bad}")
    assert ("data.images_column", f"{bad}:1") in {(p.key, p.where) for p in refused.value.problems}


@pytest.mark.slow
def test_the_image_reaches_the_chosen_and_the_rejected_forward(work):
    from overdrive.training.build.model import build_model
    from overdrive.training.objectives.preference import sequence_scores

    for name in ("qwen", "llava"):
        cfg = settled(work, name)
        batch, _ = pair_batch(cfg, 2)
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        with torch.no_grad():
            logps = sequence_scores(model, batch)[0]
            other = sequence_scores(model, {**batch, "pixel_values": batch["pixel_values"].flip(0) + 1.0})[0]
        assert (logps - other).abs().min() > 1e-6, (name, logps, other)  # each of the 4 rows sees its image


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [("qwen", ["peft.method=lora", "peft.r=8", "peft.alpha=16"]), ("llava", [])],
                         ids=["qwen2-vl-lora", "llava-full"])
def test_dpo_with_images_starts_at_ln2_and_trains(work, name, extra):
    import sys

    from checkpoint_probe import losses, run

    out = work / f"dpo-{name}"
    done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / name}",
                f"data.source={work / 'pairs.jsonl'}", "data.format=preference", "preference.method=dpo",
                "data.max_length=64", "training.micro_batch_size=4", "training.max_steps=3", "optim.lr=0.01",
                "scheduler.name=constant", "scheduler.warmup_steps=0", "data.validation_fraction=0",
                "launch.use_cpu=true", "precision.mixed_precision=no", "logging.trackers=[none]",
                "logging.progress=false", "checkpoint.enabled=false", "training.log_every_steps=1",
                f"output_dir={out}", *extra], cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    curve = losses(out)
    print(name, curve)
    assert abs(curve[1] - math.log(2)) < 1e-6, curve
    assert curve[3] != curve[1]


def by_hand(work: Path, name: str, method: str) -> float:
    """SimPO's and ORPO's step-1 loss over the 8 pairs, from the base model's log-probs by TRL's formulas (CPOTrainer's
    "simpo", ORPOTrainer's odds ratio): the NLL term over the chosen rows' real tokens, their image tokens left out."""
    import torch.nn.functional as F
    from transformers import AutoModelForImageTextToText

    batch, _ = pair_batch(settled(work, name, f"preference.method={method}"), 8)
    model = AutoModelForImageTextToText.from_pretrained(work / name).eval()
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "pair_index", "text_mask")}
    with torch.no_grad():
        logits = model(**inputs).logits[:, :-1].float()
    per_token = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    answer = (batch["labels"][:, 1:] != -100).float()
    average = (per_token * answer).sum(1) / answer.sum(1)
    chosen, rejected = average[:8], average[8:]
    beta, gamma = 0.1, 0.5  # TRL's defaults, and overdrive's
    if method == "simpo":
        return (-F.logsigmoid(beta * (chosen - rejected - gamma / beta))).mean().item()
    config = model.config
    image_ids = torch.tensor([i for i in (config.image_token_id, getattr(config, "vision_start_token_id", None),
                                          getattr(config, "vision_end_token_id", None)) if i is not None])
    text = (batch["attention_mask"] * ~torch.isin(batch["input_ids"], image_ids))[:8, 1:].float()
    nll = -(per_token[:8] * text).sum() / text.sum()
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    return (nll - beta * F.logsigmoid(log_odds).mean()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name,method,extra", [("qwen", "simpo", ["peft.method=lora", "peft.r=8", "peft.alpha=16"]),
                                               ("llava", "orpo", [])], ids=["qwen2-vl-lora-simpo", "llava-full-orpo"])
def test_simpo_and_orpo_with_images_start_at_trls_formula_by_hand(work, name, method, extra):
    import sys

    from checkpoint_probe import losses, run

    out = work / f"{method}-{name}"
    done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / name}",
                f"data.source={work / 'pairs.jsonl'}", "data.format=preference", f"preference.method={method}",
                "data.max_length=64", "training.micro_batch_size=8", "training.max_steps=2", "optim.lr=0.01",
                "data.validation_fraction=0", "launch.use_cpu=true", "precision.mixed_precision=no",
                "logging.trackers=[none]", "logging.progress=false", "checkpoint.enabled=false",
                "training.log_every_steps=1", f"output_dir={out}", *extra], cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    curve, expected = losses(out), by_hand(work, name, method)
    print(method, name, curve, "by hand", expected)
    assert abs(curve[1] - expected) <= 1e-5 * abs(expected), (curve, expected)
    assert curve[2] != curve[1]
