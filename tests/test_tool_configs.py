"""Axolotl, LLaMA-Factory and torchtune configs read as they are (fixtures in
tests/fixtures/interop/, written after those projects' documented examples): recognised by their
keys, every key with a counterpart mapped with its file:line, the tools' own defaults carried,
keys without one listed by key, math-changing ones refused by key (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from overdrive.resolving import resolve
from overdrive.config.sources import load_file
from overdrive.errors import UserError
from overdrive.interop import tool_reading

FIXTURES = Path(__file__).parent / "fixtures" / "interop"


def line_of(name: str, text: str) -> int:
    return next(i for i, line in enumerate((FIXTURES / name).read_text().splitlines(), 1) if line.strip().startswith(text))


def resolved(name: str, *cli: str, root: Path = FIXTURES):
    return resolve([root / name], cli=list(cli), env={}, accelerate_default=False)


def refused(path: Path) -> list[str]:
    with pytest.raises(UserError) as error:
        resolve([path], env={}, accelerate_default=False)
    return [p.key for p in error.value.problems]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, kind", [("axolotl-lora.yml", "axolotl"), ("axolotl-qlora-fsdp.yml", "axolotl"),
                                        ("llamafactory-lora-sft.yaml", "llamafactory"),
                                        ("llamafactory-qlora.yaml", "llamafactory"),
                                        ("torchtune-lora.yaml", "torchtune"),
                                        ("torchtune-qlora-distributed.yaml", "torchtune"),
                                        ("llamafactory-lora-dpo.yaml", "llamafactory"),
                                        ("llamafactory-lora-kto.yaml", "llamafactory"),
                                        ("axolotl-dpo-lora.yml", "axolotl"), ("axolotl-kto-qlora.yml", "axolotl"),
                                        ("torchtune-lora-dpo.yaml", "torchtune"),
                                        ("zero3_bf16.json", "deepspeed")])
def test_each_file_is_recognised_by_its_keys(name, kind):
    assert tool_reading.detect_kind(load_file(FIXTURES / name).data) == kind


def test_axolotl_lora(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    r = resolved("axolotl-lora.yml")
    c = r.config
    assert (c.model.name_or_path, c.peft.method, c.peft.r, c.peft.alpha, c.peft.dropout, c.peft.target_modules) == \
        ("NousResearch/Meta-Llama-3-8B", "lora", 32, 16.0, 0.05, "all-linear")
    assert (c.training.micro_batch_size, c.training.gradient_accumulation_steps, c.training.num_epochs) == (2, 4, 4.0)
    assert (c.optim.name, c.optim.lr, c.optim.weight_decay, c.scheduler.name, c.scheduler.warmup_steps) == \
        ("adamw_8bit", 2e-4, 0.0, "cosine", 10)
    assert c.scheduler.min_lr_ratio == 0.0  # Transformers' cosine decays to 0
    assert (c.data.max_length, c.data.packing, c.data.format, c.data.layout, c.data.source) == \
        (4096, True, "chat", "alpaca", "mhenrichsen/alpaca_2k_test")
    assert (c.precision.mixed_precision, c.model.gradient_checkpointing, c.model.attn_implementation) == \
        ("bf16", True, "flash_attention_2")
    assert (c.training.evals_per_epoch, c.checkpoint.saves_per_epoch, c.logging.trackers) == (4, 1, ["wandb"])
    origin = r.origins["peft.r"]
    assert origin.source.endswith("axolotl-lora.yml") and origin.line == line_of("axolotl-lora.yml", "lora_r:")
    assert r.origins["training.max_steps"].layer == "derived"
    unmapped = {w.key for w in r.warnings}
    assert {"pad_to_sequence_len", "eval_max_new_tokens", "special_tokens"} <= unmapped


def test_axolotl_70b_qlora_with_fsdp():
    r = resolved("axolotl-qlora-fsdp.yml")
    c = r.config
    assert (c.peft.method, c.peft.bits, c.peft.r, c.peft.alpha, c.peft.target_modules) == ("qlora", 4, 8, 16.0, "all-linear")
    assert c.parallel.strategy == "fsdp" and c.parallel.fsdp.offload_params is True
    assert c.parallel.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert r.origins["parallel.fsdp.offload_params"].line == line_of("axolotl-qlora-fsdp.yml", "fsdp_offload_params:")
    assert (c.scheduler.warmup_ratio, c.optim.name, c.optim.implementation) == (0.1, "adamw", "fused")
    assert [(s.name, s.layout, s.messages_column) for s in c.data.sources] == \
        [("alpaca", "alpaca", None), ("chats.jsonl", "sharegpt", "conversations")]
    assert "fsdp_config.fsdp_limit_all_gathers" in {w.key for w in r.warnings}


def test_axolotl_refuses_what_changes_the_math_by_key(tmp_path):
    base = "base_model: m\nadapter: lora\nmicro_batch_size: 1\n"
    assert refused(write(tmp_path, "ppo.yml", base + "rl: ppo\n")) == ["rl"]
    assert refused(write(tmp_path, "type.yml", base + "datasets:\n  - path: x\n    type: oasst\n")) == ["datasets.0.type"]
    assert refused(write(tmp_path, "optim.yml", base + "optimizer: galore_adamw\n")) == ["optimizer"]
    assert refused(write(tmp_path, "tokens.yml", base + "tokens: ['<x>']\n")) == ["tokens"]


def test_axolotl_names_its_deepspeed_json_which_reads_with_sub_group_size_0(tmp_path):
    shutil.copy(FIXTURES / "zero3_bf16.json", tmp_path / "zero3_bf16.json")
    path = write(tmp_path, "ds.yml", "base_model: m\nmicro_batch_size: 1\ndeepspeed: zero3_bf16.json\n")
    c = resolved(path.name, root=tmp_path).config
    assert (c.parallel.strategy, c.parallel.deepspeed.zero_stage, c.parallel.deepspeed.sub_group_size) == ("deepspeed", 3, 0)
    zero3 = resolved("zero3_bf16.json").config
    assert zero3.parallel.deepspeed.sub_group_size == 0 and zero3.precision.mixed_precision == "bf16"


def test_llamafactory_lora_sft_with_its_defaults(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    r = resolved("llamafactory-lora-sft.yaml")
    c = r.config
    # lora_alpha unset: LLaMA-Factory's 2 x rank, carried with its origin
    assert (c.peft.method, c.peft.r, c.peft.alpha, c.peft.dropout, c.peft.target_modules) == ("lora", 8, 16.0, 0.0, "all-linear")
    assert "2 x lora_rank" in r.origins["peft.alpha"].source
    assert (c.training.micro_batch_size, c.training.gradient_accumulation_steps, c.training.num_epochs) == (1, 8, 3.0)
    assert (c.optim.lr, c.scheduler.name, c.scheduler.warmup_ratio, c.data.max_length) == (1e-4, "cosine", 0.1, 2048)
    assert c.model.gradient_checkpointing and c.logging.trackers == [] and c.checkpoint.every_steps == 500
    assert [(s.name, s.layout, Path(s.source).name) for s in c.data.sources] == \
        [("identity", "alpaca", "identity.json"), ("alpaca_en_demo", "alpaca", "alpaca_en_demo.json")]
    assert {"max_samples", "template", "dataset"} <= {w.key for w in r.warnings}


def test_llamafactory_qlora_sharegpt_tools_and_a_missing_deepspeed_file(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    r = resolved("llamafactory-qlora.yaml")
    c = r.config
    assert (c.peft.method, c.peft.bits, c.peft.r, c.peft.alpha, c.peft.target_modules) == ("qlora", 4, 16, 32.0, ["q_proj", "v_proj"])
    assert (c.training.max_steps, c.training.num_epochs, c.scheduler.warmup_steps) == (300, None, 20)
    assert (c.data.layout, c.data.messages_column, c.data.tools_column) == ("sharegpt", "conversations", "tools")
    assert (c.parallel.strategy, c.parallel.deepspeed.zero_stage) == ("deepspeed", 2)  # from the file's name, said so
    assert (c.training.eval_every_steps, c.checkpoint.saves_per_epoch, c.data.validation_fraction) == (50, 1, 0.1)
    assert "deepspeed" in {w.key for w in r.warnings}


def test_llamafactory_refuses_other_stages_and_methods_by_key(tmp_path):
    base = "model_name_or_path: m\n"
    assert refused(write(tmp_path, "ppo.yaml", base + "stage: ppo\n")) == ["stage"]
    assert refused(write(tmp_path, "freeze.yaml", base + "stage: sft\nfinetuning_type: freeze\n")) == ["finetuning_type"]
    assert refused(write(tmp_path, "plus.yaml", base + "stage: sft\nloraplus_lr_ratio: 16\n")) == ["loraplus_lr_ratio"]


def test_torchtune_lora_maps_its_modules_to_peft_names():
    r = resolved("torchtune-lora.yaml")
    c = r.config
    assert (c.peft.method, c.peft.r, c.peft.alpha, c.peft.dropout) == ("lora", 8, 16.0, 0.0)
    assert c.peft.target_modules == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (c.training.micro_batch_size, c.training.gradient_accumulation_steps, c.training.num_epochs) == (2, 8, 1.0)
    assert (c.optim.name, c.optim.lr, c.optim.implementation, c.scheduler.name, c.scheduler.warmup_steps) == \
        ("adamw", 3e-4, "fused", "cosine", 100)
    assert c.scheduler.min_lr_ratio == 0.0 and "decays to 0" in r.origins["scheduler.min_lr_ratio"].source
    assert (c.training.gradient_clipping, c.data.max_length, c.data.layout, c.data.source) == \
        (None, 2048, "alpaca", "yahma/alpaca-cleaned")
    assert c.model.name_or_path == "/tmp/Meta-Llama-3.1-8B-Instruct/" and r.origins["model.name_or_path"].line == \
        line_of("torchtune-lora.yaml", "checkpoint_dir:")


def test_torchtune_qlora_distributed():
    c = resolved("torchtune-qlora-distributed.yaml").config
    assert (c.peft.method, c.peft.r, c.peft.alpha, c.parallel.strategy, c.parallel.fsdp.offload_params) == \
        ("qlora", 16, 32.0, "fsdp", True)
    assert (c.data.layout, c.data.messages_column, c.data.packing, c.optim.betas) == ("sharegpt", "conversations", True, (0.9, 0.95))
    assert c.logging.trackers == ["wandb"] and c.logging.project_name == "llama70b-qlora"


def test_torchtune_refuses_a_loss_it_cannot_compute(tmp_path):
    text = "checkpointer:\n  checkpoint_dir: m\nmodel:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n  lora_attn_modules: [q_proj]\nloss:\n  _component_: torchtune.rlhf.loss.RSOLoss\n"
    assert refused(write(tmp_path, "rso.yaml", text)) == ["loss._component_"]


def test_import_writes_a_config_explain_accepts(tmp_path, capsys, monkeypatch):
    from overdrive.cli import main

    monkeypatch.chdir(FIXTURES)
    out = tmp_path / "run.yaml"
    assert main(["import", "axolotl-qlora-fsdp.yml", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "pad_to_sequence_len" in err and "no counterpart" in err  # listed on stderr, by key
    written = yaml.safe_load(out.read_text())
    assert written["peft"]["method"] == "qlora" and written["peft"]["target_modules"] == "all-linear"
    assert written["parallel"]["strategy"] == "fsdp" and written["training"]["num_epochs"] == 4.0
    assert main(["explain", str(out), "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained


def test_axolotl_fsdp2_block_without_prefixes(tmp_path):
    # Axolotl's newer form (docs: multi-gpu FSDP2): fsdp_version at the top, fsdp_config keys unprefixed.
    text = ("base_model: m\nadapter: qlora\nload_in_4bit: true\nmicro_batch_size: 1\nfsdp_version: 2\nfsdp_config:\n"
            "  offload_params: true\n  auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            "  transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  state_dict_type: FULL_STATE_DICT\n"
            "  reshard_after_forward: true\n")
    r = resolved(write(tmp_path, "fsdp2.yml", text).name, root=tmp_path)
    c = r.config
    assert (c.parallel.strategy, c.parallel.fsdp.version, c.parallel.fsdp.offload_params) == ("fsdp", 2, True)
    assert r.origins["parallel.fsdp.offload_params"].line == 7
    assert not [w for w in r.warnings if w.key.startswith("fsdp")]


def test_tool_defaults_never_outrank_the_command_line():
    r = resolved("torchtune-lora.yaml", "training.max_steps=5", "scheduler.min_lr_ratio=0.1")
    assert (r.config.training.max_steps, r.config.training.num_epochs, r.config.scheduler.min_lr_ratio) == (5, None, 0.1)
    assert "training.num_epochs" in {w.key for w in r.warnings}  # the epochs the file set are not used, and said so


def test_llamafactory_v1_form(tmp_path, monkeypatch):
    # After LLaMA-Factory's examples/v1/train_qlora/quantization.yaml and data/v1_sft_demo.yaml.
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "v1_sft.yaml", "alpaca_en_demo:\n  path: data/alpaca_en_demo.json\n  source: local\n  converter: alpaca\n")
    text = ("model: Qwen/Qwen3-0.6B\nmodel_class: llm\npeft_config:\n  name: lora\n  r: 16\n  lora_alpha: 32\n"
            "  target_modules: all\ndist_config:\n  name: fsdp2\nquant_config:\n  name: bnb\n  quantization_bit: 4\n"
            "train_dataset: v1_sft.yaml\noutput_dir: outputs/q\nmicro_batch_size: 2\ncutoff_len: 1024\n"
            "learning_rate: 1.0e-4\nmax_steps: 10\nsample_backend: hf\n")
    r = resolved(write(tmp_path, "v1.yaml", text).name, root=tmp_path)
    c = r.config
    assert (c.model.name_or_path, c.peft.method, c.peft.bits, c.peft.r, c.peft.alpha, c.peft.dropout) == \
        ("Qwen/Qwen3-0.6B", "qlora", 4, 16, 32.0, 0.05)
    assert (c.parallel.strategy, c.training.micro_batch_size, c.training.max_steps, c.data.max_length) == ("fsdp", 2, 10, 1024)
    assert (c.data.layout, c.scheduler.name, c.scheduler.warmup_steps, c.precision.mixed_precision) == \
        ("alpaca", "constant", 0, "bf16")
