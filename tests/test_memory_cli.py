"""`overdrive estimate` and `overdrive plan` as a user types them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_cli
from overdrive.config.schema import RunConfig

LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "vocab_size": 32000,
}
ROWS = {"ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fsdp2"}
KEYS = {"strategy", "params_bytes", "grads_bytes", "optimizer_bytes", "master_weights_bytes", "activations_bytes",
        "buffers_bytes", "total_bytes", "host_bytes", "fits"}


@pytest.fixture
def llama_dir(tmp_path):
    path = tmp_path / "llama-7b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_7B))
    return path


@pytest.mark.slow
def test_estimate_7b_config_json(llama_dir, tmp_path):
    plot = tmp_path / "bars.png"
    done = run_cli("estimate", str(llama_dir / "config.json"), "--devices", "4", "--precision", "bf16",
                   "--micro-batch", "1", "--seq-len", "2048", "--gpu-memory", "80", "--json", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["parameters"] == pytest.approx(6.74e9, rel=0.01)
    assert data["devices"] == 4
    rows = {row["strategy"]: row for row in data["rows"]}
    assert ROWS <= set(rows)
    for row in rows.values():
        assert KEYS <= set(row)
        assert isinstance(row["fits"], bool)
    # 16 bytes per parameter does not fit an 80 GiB GPU; sharded states do.
    assert not rows["ddp"]["fits"] and rows["zero3"]["fits"]
    assert data["cheapest_fitting"] == "zero1"
    assert rows["zero3"]["total_bytes"] < rows["zero2"]["total_bytes"] < rows["ddp"]["total_bytes"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_estimate_table_from_a_directory(llama_dir):
    done = run_cli("estimate", str(llama_dir), "--devices", "8", "--gpu-memory", "80")
    assert done.returncode == 0, done.stderr
    assert "6.74B parameters" in done.stdout
    assert "cheapest that fits" in done.stdout
    for name in ROWS:
        assert f"\n{name} " in done.stdout


def test_estimate_run_yaml(tmp_path, capsys):
    from overdrive.cli import main

    run = tmp_path / "run.yaml"
    run.write_text("launch:\n  num_processes: 2\ntraining:\n  micro_batch_size: 4\ndata:\n  max_length: 128\n"
                   "parallel:\n  strategy: deepspeed\n")
    assert main(["estimate", str(run), "precision.mixed_precision=bf16", "--json", "--strategies", "ddp,zero2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["devices"], data["micro_batch"], data["seq_len"], data["precision"]) == (2, 4, 128, "bf16")
    assert [row["strategy"] for row in data["rows"]] == ["ddp", "zero2"]
    # The default model, a GPT-2 counted by hand: tied embeddings, positions, 12d^2 + 13d per
    # layer (attention, MLP, two LayerNorms, biases), the final LayerNorm.
    default = RunConfig()
    arch, vocab = default.model.architecture, default.tokenizer.vocab_size
    d, layers, positions = arch["n_embd"], arch["n_layer"], arch["n_positions"]
    assert data["parameters"] == vocab * d + positions * d + layers * (12 * d * d + 13 * d) + 2 * d


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["estimate", "no/such-model-anywhere"], "is not in the local cache"),
    (["estimate", "missing.yaml"], "no such run config"),
    (["estimate", "x.yaml", "--devices", "0"], "--devices"),
])
def test_estimate_user_errors(args, message):
    done = run_cli(*args, env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_commands_do_not_import_torch_to_parse():
    code = ("import sys, argparse\nimport overdrive.cli as cli\ncli.build_parser()\n"
            "from overdrive.commands import estimate, plan\n"
            "for m in (estimate, plan): m.add_arguments(argparse.ArgumentParser())\n"
            "import overdrive.memory, overdrive.memory.report, overdrive.memory.plan\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False False", done.stderr


def test_plan_default_run(tmp_path, capsys):
    from overdrive.cli import main

    out = tmp_path / "out"
    # A cache of its own: with the default run's tokens already cached (any earlier run on
    # this machine), plan counts them exactly instead of estimating.
    assert main(["plan", f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    training, seq_len = RunConfig().training, RunConfig().data.max_length
    global_batch = training.micro_batch_size * training.gradient_accumulation_steps
    assert data["global_batch"] == global_batch
    assert data["tokens_per_step"] == global_batch * seq_len
    assert not data["data_exact"] and "bytes per token" in data["data_basis"] and "standard-library" in data["data_basis"]
    assert data["steps_per_epoch"] == int(data["data_tokens"] * 0.98) // seq_len // global_batch
    assert data["memory"]["strategy"] == "ddp" and data["memory"]["total_bytes"] > 0
    assert data["step_time_s"] is None


def test_plan_predicts_step_time_from_metrics(tmp_path, capsys):
    from overdrive.cli import main

    out = tmp_path / "out"
    out.mkdir()
    lines = [{"step": 10, "tokens_per_s": 100.0, "loss": 5.0}]  # warm-up, left out
    lines += [{"step": 10 * i, "tokens_per_s": 2048.0, "loss": 4.0, "num_processes": 2, "micro_batch_size": 8,
               "seq_len": 256} for i in range(2, 6)]
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    argv = ["plan", f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "launch.num_processes=2", "mbs=8",
            "accum=2"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["global_batch"] == 8 * 2 * 2
    assert data["tokens_per_s"] == 2048.0
    assert data["step_time_s"] == pytest.approx(32 * 256 / 2048.0)
    assert data["total_time_s"] == pytest.approx(data["step_time_s"] * RunConfig().training.max_steps)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "global batch 32" in text and "tokens/s measured" in text and "estimate:" in text


def test_reading_a_model_config_leaves_transformers_log_level_as_it_was():
    from transformers.utils import logging

    from overdrive.config.schema import RunConfig as Config
    from overdrive.memory.model_shape import hf_config_for_run

    before = logging.get_verbosity()
    logging.set_verbosity_info()
    try:
        hf_config_for_run(Config())
        assert logging.get_verbosity() == logging.INFO
    finally:
        logging.set_verbosity(before)
