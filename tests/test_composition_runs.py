"""Combinations the composed step runs, on 2 CPU processes against one at the same global batch:
chat data that is not packed under pipeline stages (rows of varying length padded to one length,
so the stages' messages keep their size from step to step)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import free_port, run_cli
from hf_fixtures import make_chat_data, make_tiny_llama
from strategy_probe import losses_of

pytestmark = pytest.mark.slow

CHAT = ["data.format=chat", "data.packing=false", "data.max_length=48", "data.validation_fraction=0",
        "training.micro_batch_size=2", "training.gradient_accumulation_steps=2", "training.max_steps=4",
        "training.log_every_steps=1", "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0",
        "precision.mixed_precision=no", "launch.use_cpu=true", "checkpoint.enabled=false",
        "logging.trackers=[none]", "logging.progress=false", "data.shuffle=false"]


def test_unpacked_chat_under_pipeline_stages_gives_the_one_process_losses(tmp_path: Path):
    make_tiny_llama(tmp_path / "base")
    make_chat_data(tmp_path / "chat.jsonl", rows=40, prompt_letters=9)
    losses = {}
    for name, items in {"one": ["launch.num_processes=1"],
                        "pp2": ["launch.num_processes=2", "parallel.pp_size=2", f"launch.main_process_port={free_port()}"]}.items():
        done = run_cli("train", f"model.name_or_path={tmp_path / 'base'}", f"data.source={tmp_path / 'chat.jsonl'}",
                       f"data.cache_dir={tmp_path / 'cache'}", *CHAT, *items, f"output_dir={tmp_path / name}")
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = losses_of(tmp_path / name)
    assert len(losses["one"]) == 4
    assert losses["pp2"] == pytest.approx(losses["one"], rel=1e-3)


def test_the_docs_dpo_command_trains_as_written(tmp_path: Path):
    """docs/preference.md's step 2, on a tiny Llama and pairs made here (2 steps)."""
    from hf_fixtures import make_preference_data

    repo = Path(__file__).resolve().parents[1]
    make_tiny_llama(tmp_path / "base")
    make_preference_data(tmp_path / "pairs.jsonl", rows=24)
    done = run_cli("train", str(repo / "configs" / "dpo-lora.yaml"), f"model.name_or_path={tmp_path / 'base'}",
                   f"data.source={tmp_path / 'pairs.jsonl'}", "precision.mixed_precision=no", "data.max_length=64",
                   "training.max_steps=2", "training.eval_every_steps=null", "launch.use_cpu=true",
                   f"data.cache_dir={tmp_path / 'c'}", f"output_dir={tmp_path / 'dpo'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dpo on preference pairs" in done.stdout + done.stderr
    assert losses_of(tmp_path / "dpo")[0] == pytest.approx(0.6931, abs=1e-3)  # ln 2: the policy is its reference
