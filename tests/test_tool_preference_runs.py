"""LLaMA-Factory's DPO config and Axolotl's `rl: dpo` config (tests/fixtures/interop/, after those
projects' example files) trained as they are for 2 steps on local material: a tiny Llama and pairs
in each tool's own layout (LLaMA-Factory's ShareGPT pairs, Axolotl's chat_template.default rows).
Only what cannot hold on a CPU and a 2-layer model is overridden on the command line."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
from checkpoint_probe import records, run
from hf_fixtures import LETTERS, make_tiny_llama

pytestmark = pytest.mark.slow  # each test trains in a process of its own

FIXTURES = Path(__file__).parent / "fixtures" / "interop"
# the model and the machine: a local 2-layer Llama with 128 positions, on CPU without bf16 or flash-attention
LOCAL = ["precision.mixed_precision=no", "launch.use_cpu=true", "data.max_length=64", "training.max_steps=2",
         "data.num_workers=0", "model.attn_implementation=sdpa", "logging.progress=false", "logging.trackers=[none]",
         "training.log_every_steps=1"]


def _pairs(rows: int = 24, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(rows):
        letters = [rng.choice(LETTERS) for _ in range(5)]
        yield " ".join(letters), f"the answer is {letters[0]}", "the answer is yes"


def _train(tmp_path: Path, config: str, *items: str):
    make_tiny_llama(tmp_path / "base")
    done = run([sys.executable, "-m", "overdrive.cli", "train", config, f"model.name_or_path={tmp_path / 'base'}",
                f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", *LOCAL, *items],
               cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resolved = json.loads((tmp_path / "out" / "resolved.json").read_text())
    logged = [r for r in records(tmp_path / "out") if "loss" in r]
    return resolved, logged, done.stdout + done.stderr


def test_llamafactory_dpo_config_trains_on_its_sharegpt_pairs(tmp_path):
    shutil.copy(FIXTURES / "llamafactory-lora-dpo.yaml", tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copy(FIXTURES / "data" / "dataset_info.json", tmp_path / "data")
    (tmp_path / "data" / "dpo_en_demo.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": prompt}], "chosen": {"from": "gpt", "value": good},
         "rejected": {"from": "gpt", "value": bad}} for prompt, good, bad in _pairs()]))
    resolved, logged, said = _train(tmp_path, "llamafactory-lora-dpo.yaml")
    c = resolved["config"]
    assert (c["preference"]["method"], c["preference"]["beta"], c["peft"]["method"], c["peft"]["r"]) == ("dpo", 0.1, "lora", 8)
    assert (c["data"]["layout"], c["training"]["gradient_accumulation_steps"], c["optim"]["lr"]) == ("sharegpt", 8, 5e-6)
    assert "llamafactory-lora-dpo.yaml:12" in json.dumps(resolved["origins"]["preference.beta"])
    assert [r["step"] for r in logged] == [1, 2] and "rewards/accuracies" in said
    assert abs(logged[0]["loss"] - 0.6931) < 1e-3 and "rewards/accuracies" in logged[-1]


def test_axolotl_rl_dpo_config_trains_on_its_chat_template_rows(tmp_path):
    shutil.copy(FIXTURES / "axolotl-dpo-lora.yml", tmp_path)
    (tmp_path / "dpo_pairs.jsonl").write_text("".join(json.dumps(
        {"conversation": [{"role": "user", "content": prompt}], "chosen": {"role": "assistant", "content": good},
         "rejected": {"role": "assistant", "content": bad}}) + "\n" for prompt, good, bad in _pairs()))
    resolved, logged, said = _train(tmp_path, "axolotl-dpo-lora.yml", "data.validation_fraction=0")
    c = resolved["config"]
    assert (c["preference"]["method"], c["preference"]["beta"], c["preference"]["label_smoothing"]) == ("dpo", 0.2, 0.05)
    assert (c["peft"]["r"], c["peft"]["alpha"], c["peft"]["target_modules"]) == (32, 16.0, "all-linear")
    assert (c["data"]["prompt_column"], c["training"]["micro_batch_size"]) == ("conversation", 2)
    assert [r["step"] for r in logged] == [1, 2] and logged[0]["loss"] > 0
