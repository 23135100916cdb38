"""A vision-language model under the sharded layouts (docs/vision.md, "What composes"): SFT of a tiny Qwen2-VL (its
vision tower and projector frozen) on 2 CPU processes at 2 rows each gives the one-process losses at 4 rows over
3 steps: the language model in full under FSDP2 with gradient checkpointing, and LoRA under DeepSpeed ZeRO-3, whose
saved adapter reloads on its base. GRPO with image prompts under FSDP2 and ZeRO-3: tests/test_vlm_grpo.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from vlm_fixtures import make_tiny_qwen2_vl, make_vision_data

RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0", "training.max_steps=3",
       "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0", "training.log_every_steps=1",
       "precision.mixed_precision=no", "launch.use_cpu=true", "logging.trackers=[none]", "logging.progress=false",
       "checkpoint.enabled=false"]
LORA = ["peft.method=lora", "peft.r=8", "peft.alpha=16"]


@pytest.mark.slow
def test_fsdp2_and_zero3_on_two_processes_give_the_one_process_losses(tmp_path: Path):
    import transformers
    from checkpoint_probe import losses, run
    from peft import PeftModel
    from strategy_probe import free_port

    make_tiny_qwen2_vl(tmp_path / "qwen")
    make_vision_data(tmp_path, rows=24, layout="messages")

    def train(out: str, *extra: str) -> dict[int, float]:
        done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={tmp_path / 'qwen'}",
                    f"data.source={tmp_path / 'messages.jsonl'}", *RUN, f"output_dir={tmp_path / out}", *extra],
                   cwd=tmp_path, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return losses(tmp_path / out)

    two = ["training.micro_batch_size=2", "launch.num_processes=2"]
    pairs = {"fsdp2, full, gradient checkpointing": (
                 train("one", "training.micro_batch_size=4"),
                 train("fsdp2", *two, "parallel.strategy=fsdp", "model.gradient_checkpointing=true",
                       f"launch.main_process_port={free_port()}")),
             "zero3, lora": (
                 train("one-lora", "training.micro_batch_size=4", *LORA),
                 train("zero3-lora", *two, *LORA, "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                       f"launch.main_process_port={free_port()}"))}
    for name, (one, curve) in pairs.items():
        print(name, one, curve)
        assert sorted(curve) == [1, 2, 3], name
        for step, loss in one.items():
            assert abs(curve[step] - loss) <= 1e-5 * loss, (name, step, loss, curve[step])
    base = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "qwen")  # the adapter on its base
    model = PeftModel.from_pretrained(base, tmp_path / "zero3-lora" / "model")
    assert all("language_model" in n for n, _ in model.named_parameters() if "lora_" in n)
