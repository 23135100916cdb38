"""`overdrive import` takes KEY=VALUE items (a refusal's fix that names one can be followed), and
Axolotl's `rl: grpo` maps onto `rl.*` as far as its keys correspond."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import run_here

from overdrive.errors import UserError
from overdrive.resolving import resolve

# LLaMA-Factory's own examples/train_lora/llama3_lora_sft.yaml (its data sets live in its data/dataset_info.json).
LLAMA3_LORA_SFT = """\
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: identity, alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
output_dir: saves/llama3-8b/lora/sft
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
"""


def fix_commands(text: str) -> list[str]:
    """The `overdrive ...` commands a refusal's fix lines offer."""
    return [line.split("overdrive ", 1)[1].strip() for line in text.splitlines()
            if "fix:" in line and "overdrive import" in line]


def test_a_llamafactory_data_set_not_at_hand_is_given_on_the_import_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("llama3_lora_sft.yaml").write_text(LLAMA3_LORA_SFT)
    Path("data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    refused = run_here("import", "llama3_lora_sft.yaml")
    assert refused.returncode == 2 and "'identity' cannot be found" in refused.stderr
    offered = fix_commands(refused.stderr)
    assert offered, refused.stderr
    # The fix, followed as written with its placeholder filled in:
    command = offered[0].replace("PATH_OR_HUB_NAME", "data.jsonl").split()
    done = run_here(*command)
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load(Path("run.yaml").read_text())
    assert written["data"]["source"] == "data.jsonl" and written["data"]["format"] == "chat"
    assert written["peft"]["r"] == 8  # the rest of the file imported as before
    assert resolve(["run.yaml"], env={}, accelerate_default=False).config.data.source == "data.jsonl"


def test_import_without_a_file_is_refused(tmp_path):
    done = run_here("import", "data.source=x.jsonl")
    assert done.returncode == 2 and "no file to import" in done.stderr


AXOLOTL_GRPO = """\
base_model: m
rl: grpo
trl:
  beta: 0.001
  max_completion_length: 64
  num_generations: 4
  temperature: 0.9
  epsilon_high: 0.28
  loss_type: dr_grpo
  scale_rewards: false
  use_vllm: true
  reward_funcs: [my_rewards.short, my_rewards.exact]
  reward_weights: [1.0, 0.5]
datasets:
  - path: prompts.jsonl
micro_batch_size: 4
gradient_accumulation_steps: 1
sequence_len: 256
"""


def test_axolotl_grpo_maps_its_trl_block_onto_rl_keys(tmp_path):
    path = tmp_path / "grpo.yml"
    path.write_text(AXOLOTL_GRPO)
    r = resolve([path], env={}, accelerate_default=False)
    rl = r.config.rl
    assert (rl.method, rl.beta, rl.max_completion_length, rl.num_generations, rl.temperature) == \
        ("grpo", 0.001, 64, 4, 0.9)
    assert (rl.epsilon_high, rl.loss_type, rl.scale_rewards) == (0.28, "dr_grpo", "none")
    assert [(f.function, f.weight) for f in rl.reward_funcs] == [("my_rewards.short", 1.0), ("my_rewards.exact", 0.5)]
    assert r.config.data.format == "prompts" and r.config.data.source == "prompts.jsonl"
    assert r.origins["rl.beta"].line == 4
    assert "trl.use_vllm" in {w.key for w in r.warnings}


@pytest.mark.parametrize("extra, key", [("  sync_ref_model: true\n", "trl.sync_ref_model"),
                                        ("  loss_type: cispo\n", "trl.loss_type")])
def test_axolotl_grpo_refuses_only_the_keys_without_a_counterpart(tmp_path, extra, key):
    path = tmp_path / "grpo.yml"
    path.write_text(AXOLOTL_GRPO.replace("  use_vllm: true\n", "  use_vllm: true\n" + extra)
                    .replace("  loss_type: dr_grpo\n", "" if "loss_type" in extra else "  loss_type: dr_grpo\n"))
    with pytest.raises(UserError) as error:
        resolve([path], env={}, accelerate_default=False)
    assert [p.key for p in error.value.problems] == [key]


def test_an_axolotl_grpo_transform_dataset_type_is_refused_by_its_key(tmp_path):
    path = tmp_path / "grpo.yml"
    path.write_text(AXOLOTL_GRPO.replace("  - path: prompts.jsonl\n",
                                         "  - path: openai/gsm8k\n    type: rewards.oai_gsm8k_transform\n"))
    with pytest.raises(UserError) as error:
        resolve([path], env={}, accelerate_default=False)
    assert [p.key for p in error.value.problems] == ["datasets.0.type"]


def test_a_credential_imported_is_never_echoed_and_train_refuses_its_mask_by_key(tmp_path, monkeypatch):
    """A credentialed URL in an imported file: masked on every output (the file, stdout, stderr), the
    masked key said, and a run of the written file refused by that key until the value is given."""
    monkeypatch.chdir(tmp_path)
    token = "hf_" + "a1b2c3d4e5" * 4
    (tmp_path / "axolotl.yml").write_text(f"base_model: gpt2\ndatasets:\n  - path: https://me:{token}@example.com/"
                                          "d.jsonl\n    type: completion\nmicro_batch_size: 2\n")
    done = run_here("import", "axolotl.yml", "-o", "run.yaml")
    written = (tmp_path / "run.yaml").read_text()
    assert done.returncode == 0 and token not in done.stdout + done.stderr + written, done.stderr
    assert "data.source: a credential is masked" in done.stderr
    assert yaml.safe_load(written)["data"]["source"] == "https://***@example.com/d.jsonl"
    with pytest.raises(UserError) as caught:
        resolve(["run.yaml"], env={}, accelerate_default=False)
    assert [p.key for p in caught.value.problems] == ["data.source"] and "data.source=" in caught.value.problems[0].fix
