"""A vision-language model under the sharded layouts (docs/vision.md, "What composes"): full SFT of a tiny Qwen2-VL
(its vision tower and projector frozen) under FSDP2 and under DeepSpeed ZeRO-3 on 2 CPU processes gives the
one-process losses at the same global batch over 3 steps, and gradient checkpointing changes no loss.
The adapter runs under FSDP2: tests/test_vlm.py.
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


@pytest.mark.slow
def test_fsdp2_and_zero3_on_two_processes_and_checkpointing_give_the_one_process_losses(tmp_path: Path):
    from checkpoint_probe import losses, run
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
    one = train("one", "training.micro_batch_size=4")
    runs = {"fsdp2": train("fsdp2", *two, "parallel.strategy=fsdp", f"launch.main_process_port={free_port()}"),
            "zero3": train("zero3", *two, "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                           f"launch.main_process_port={free_port()}"),
            "checkpointing": train("checkpointing", "training.micro_batch_size=4", "model.gradient_checkpointing=true")}
    print("one process", one, runs)
    for name, curve in runs.items():
        assert sorted(curve) == [1, 2, 3], name
        for step, loss in one.items():
            assert abs(curve[step] - loss) <= 1e-5 * loss, (name, step, loss, curve[step])
