"""N-D layouts on CPU processes over gloo give the one-process losses at the same global batch.

A small Llama built from `model.architecture` (it has Transformers' tensor-parallel plan), fp32:
TP 2 on 2 processes (data-parallel degree 1), HSDP 2 x 2 and FSDP2 2 x TP 2 on 4 processes
(degree 4 and 2); the micro-batch makes up the rest of the global batch of 8. Tolerance: 1e-3
relative per logged step (the issue's bound; the measured differences are ~1e-7).
"""

from __future__ import annotations

import json

import pytest
from strategy_probe import REPO, free_port, losses_of, train

pytestmark = pytest.mark.slow

LLAMA = [
    "model.architecture.model_type=llama", "model.architecture.hidden_size=32",
    "model.architecture.intermediate_size=64", "model.architecture.num_hidden_layers=2",
    "model.architecture.num_attention_heads=4", "model.architecture.num_key_value_heads=2",
    "model.architecture.max_position_embeddings=64", "training.max_steps=3", "checkpoint.enabled=false",
    "training.eval_every_steps=null", "checkpoint.save_final_model=true",  # the run ends with its final save
]
GLOBAL_BATCH = 8
LAYOUTS = {  # name: (processes, overrides)
    "tp2": (2, ["parallel.strategy=ddp", "parallel.tp_size=2"]),
    "hsdp2x2": (4, ["parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "parallel.dp_shard_size=2"]),
    "fsdp2xtp2": (4, ["parallel.strategy=fsdp", "parallel.dp_shard_size=2", "parallel.tp_size=2"]),
}


def _run(tmp_path, name, processes, overrides, micro):
    done = train(str(REPO / "configs" / "ddp.yaml"), *LLAMA, *overrides, f"launch.num_processes={processes}",
                 f"training.micro_batch_size={micro}", f"launch.main_process_port={free_port()}",
                 output_dir=tmp_path / name, cache_dir=tmp_path / "cache", timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return losses_of(tmp_path / name)


def test_tp_hsdp_and_fsdp_x_tp_match_one_process(tmp_path):
    expected = _run(tmp_path, "one", 1, [], GLOBAL_BATCH)
    assert len(expected) == 3 and expected[-1] < expected[0]
    for name, (processes, overrides) in LAYOUTS.items():
        data_parallel = {"tp2": 1, "hsdp2x2": 4, "fsdp2xtp2": 2}[name]
        got = _run(tmp_path, name, processes, overrides, GLOBAL_BATCH // data_parallel)
        assert len(got) == len(expected), name
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
        assert worst <= 1e-3, f"{name}: {got} vs one process {expected}"
        _assert_whole_model(tmp_path / name / "model", tmp_path / "one" / "model")
        resolved = json.loads((tmp_path / name / "resolved.json").read_text())["config"]["parallel"]
        assert resolved["tp_size"] == (2 if "tp" in name else 1)


def _assert_whole_model(saved, reference) -> None:
    """The final save completed on every rank: the model directory holds every tensor whole."""
    from safetensors.torch import load_file

    got, expected = load_file(saved / "model.safetensors"), load_file(reference / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in expected.items()}
