"""The step-1 loss of LoRA SFT on a vision-language model (docs/vision.md, "A worked example"): a run's first loss
equals the model's own loss (its forward with `labels`) over the same rows, encoded by the model's own processor
class and masked to the assistant's answer, to 1e-4; LLaMA-Factory's ShareGPT and Alpaca rows give TRL's layout's
step-1 loss. Tiny Qwen2-VL, Qwen3-VL and LLaVA models; 4 rows, all of them in step 1 (so the order they are drawn in does
not matter). LoRA starts with its B matrices at zero: the step-1 model is the base model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from vlm_fixtures import make_tiny_models, make_tiny_qwen3_vl, make_vision_data, processor_class_of

RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0", "training.max_steps=1",
       "training.micro_batch_size=4", "peft.method=lora", "peft.r=8", "peft.alpha=16", "optim.lr=0.01",
       "training.log_every_steps=1", "precision.mixed_precision=no", "launch.use_cpu=true", "logging.trackers=[none]",
       "logging.progress=false", "checkpoint.enabled=false", "checkpoint.save_final_model=false"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = make_tiny_models(tmp_path_factory.mktemp("vlm-step-one"))
    make_tiny_qwen3_vl(root / "qwen3")
    for layout in ("messages", "sharegpt", "alpaca"):
        make_vision_data(root, rows=4, layout=layout)
    return root


def the_models_own_loss(work: Path, name: str) -> float:
    """The rows (TRL's layout) through the model's processor class and chat template in one batch, the labels the
    tokens after the assistant's turn opens (its answer and <|im_end|>), the loss the model's own."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = processor_class_of(work / name)
    rows = [json.loads(line) for line in (work / "messages.jsonl").read_text().splitlines()]
    texts = [processor.tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    images = [Image.open(work / r["images"][0]).convert("RGB") for r in rows]
    batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
    labels = torch.full_like(batch["input_ids"], -100)
    opens = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    for i, ids in enumerate(batch["input_ids"].tolist()):
        answer = max(j for j, t in enumerate(ids) if t == opens) + 2  # <|im_start|> assistant \n: the answer next
        end = answer + ids[answer:].index(processor.tokenizer.eos_token_id) + 1
        labels[i, answer:end] = batch["input_ids"][i, answer:end]
    model = AutoModelForImageTextToText.from_pretrained(work / name).eval()
    with torch.no_grad():
        return model(**batch, labels=labels).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen", "qwen3", "llava"])
def test_lora_sft_step_one_is_the_models_own_loss_in_every_layout(work, name):
    from checkpoint_probe import losses, run

    def step_one(layout: str) -> float:
        out = work / f"{name}-{layout}"
        done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / name}",
                    f"data.source={work / (layout + '.jsonl')}", *RUN, f"output_dir={out}"], cwd=work, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return losses(out)[1]

    own = the_models_own_loss(work, name)
    trl, sharegpt, alpaca = step_one("messages"), step_one("sharegpt"), step_one("alpaca")
    print(f"{name}: the model's own loss {own:.7f}; step 1: TRL's layout {trl:.7f}, ShareGPT {sharegpt:.7f}, "
          f"Alpaca {alpaca:.7f}")
    assert abs(trl - own) <= 1e-4 * own, (trl, own)
    assert sharegpt == pytest.approx(trl, abs=1e-6) and alpaca == pytest.approx(trl, abs=1e-6)
