"""LoRA fine-tuning on chat data, run as a user types it: a 2-layer Llama saved with
save_pretrained, a tokenizer with a chat template, conversations whose prompts are random
letters and whose answer is always "the answer is yes".

One one-process run is the reference (assistant-only loss, a checkpoint every 8 steps, the
merged model written); the other runs are compared with it: DDP, ZeRO-3 and FSDP2 on 2
processes at the same global batch, the prompt trained on, a run killed and resumed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from checkpoint_probe import losses, records, run, killed_then_resumed
from hf_fixtures import make_chat_data, make_tiny_llama, tree_hash
from strategy_probe import REPO, free_port

pytestmark = pytest.mark.slow  # every test here starts processes and trains

STEPS = 20
ANSWER_TOKENS = 5  # "the answer is yes <eos>"
PROMPT_LETTERS = 12
RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0.1", "peft.method=lora", "peft.r=4",
       "peft.alpha=8", "peft.modules_to_save=[lm_head]", "training.micro_batch_size=4", "training.log_every_steps=1",
       "training.eval_every_steps=null", "training.eval_batches=2", "optim.lr=0.02", "scheduler.name=constant",
       "scheduler.warmup_steps=0", "precision.mixed_precision=no", "launch.use_cpu=true", "logging.trackers=[none]",
       "logging.progress=false"]



@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    make_tiny_llama(root / "base")
    make_chat_data(root / "chat.jsonl", rows=80, prompt_letters=PROMPT_LETTERS)
    (root / "base.sha256").write_text(repr(tree_hash(root / "base")))
    return root


def command(work: Path, out: str, *extra: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'base'}",
            f"data.source={work / 'chat.jsonl'}", f"data.cache_dir={work / 'cache'}", *RUN,
            f"output_dir={work / out}", *extra]


REFERENCE = [f"training.max_steps={STEPS}", "checkpoint.every_steps=8", "peft.save_merged=true"]


@pytest.fixture(scope="module")
def reference(work) -> Path:
    done = run(command(work, "reference", *REFERENCE), cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "trainable parameters:" in done.stdout
    return work / "reference"


def test_assistant_only_loss_learns_the_answer_and_the_prompt_cannot_be_learned(work, reference):
    """Behaviour, not the mask: the constant answer is learned to a loss near zero; random
    letters cannot be predicted (at least ln 26 nats each), so with the prompt in the loss it stays high."""
    logged = records(reference)
    trained = [r for r in logged if "loss" in r]
    assert trained[-1]["loss"] < 0.05, [r["loss"] for r in trained]
    assert {r["loss_tokens"] for r in trained} == {4 * ANSWER_TOKENS}  # 4 conversations a step, 5 tokens each
    done = run(command(work, "prompt", f"training.max_steps={STEPS}", "data.train_on_prompt=true",
                       "checkpoint.enabled=false", "checkpoint.save_final_model=false"), cwd=work, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    prompt = [r for r in records(work / "prompt") if "loss" in r]
    # <user> 12 letters <eos> <assistant> the answer is yes <eos>: 20 tokens, 19 predicted.
    assert {r["loss_tokens"] for r in prompt} == {4 * (PROMPT_LETTERS + 7)}
    floor = PROMPT_LETTERS * math.log(26) / (PROMPT_LETTERS + 7)
    assert prompt[-1]["loss"] > 0.8 * floor > 1.0, [r["loss"] for r in prompt]


def test_two_processes_under_zero3_and_fsdp2_match_one(work, reference):
    """The adapter under the two engines that shard it (DDP's plain replicas are the loss
    normalisation tests')."""
    from safetensors.torch import load_file

    expected = losses(reference)
    strategies = {"zero3": "configs/zero3.yaml", "fsdp2": "configs/fsdp.yaml"}
    table = {}
    for name, config in strategies.items():
        done = run(command(work, name, str(REPO / config), "training.max_steps=4", "launch.num_processes=2",
                           "training.micro_batch_size=2", "precision.mixed_precision=no",
                           f"launch.main_process_port={free_port()}"), cwd=work, timeout=900)
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-3000:]
        got = losses(work / name)
        table[name] = got
        assert sorted(got) == [1, 2, 3, 4]
        for step, loss in got.items():
            assert abs(loss - expected[step]) <= 1e-3 * abs(expected[step]), (name, step, loss, expected[step])
        # The adapter was gathered from the shards and saved as PEFT's adapter file.
        adapter = load_file(work / name / "model" / "adapter_model.safetensors")
        assert any("lora_B" in k for k in adapter) and all(("lora_" in k or "lm_head" in k) for k in adapter)
        assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    print({name: [round(got[s], 6) for s in sorted(got)] for name, got in table.items()})


def test_the_adapter_loads_onto_the_base_and_the_merged_model_gives_the_same_loss(work, reference):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert repr(tree_hash(work / "base")) == (work / "base.sha256").read_text()  # never written to
    tokenizer = AutoTokenizer.from_pretrained(reference / "model")
    turns = [{"role": "user", "content": "a b c d"}, {"role": "assistant", "content": "the answer is yes"}]
    ids = torch.tensor([tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "base"), reference / "model")
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # trained (PEFT initialises B to zero)
    merged = AutoModelForCausalLM.from_pretrained(reference / "merged")
    with torch.no_grad():
        a = adapted.eval()(input_ids=ids, labels=ids).loss.item()
        b = merged.eval()(input_ids=ids, labels=ids).loss.item()
    assert abs(a - b) <= 1e-4, (a, b)
    assert repr(tree_hash(work / "base")) == (work / "base.sha256").read_text()


def test_a_killed_lora_run_resumes_exactly_from_a_small_checkpoint(work, reference):
    from safetensors.torch import load_file

    out = work / "killed"
    killed_then_resumed(command(work, "killed", *REFERENCE), work, out, 8, 2, timeout=600)
    assert losses(out) == losses(reference)
    checkpoint = out / "checkpoints" / "step-00000016"
    weights = load_file(checkpoint / "model.safetensors")
    assert weights and all("lora_" in k or "modules_to_save" in k for k in weights)
    model, optimizer = ((checkpoint / name).stat().st_size for name in ("model.safetensors", "optimizer.bin"))
    base = (work / "base" / "model.safetensors").stat().st_size
    # A full checkpoint holds the fp32 weights and Adam's two fp32 moments: about 3 x base. Here the
    # adapter and the lm_head copy are a fifth of this tiny model; pickling overhead is the rest.
    assert model < 0.35 * base and model + optimizer < 0.4 * 3 * base, (model, optimizer, base)
    print(f"LoRA checkpoint: weights {model:,} + optimizer {optimizer:,} bytes; base weights {base:,} bytes")


def test_qlora_trains_on_the_cpu_through_bitsandbytes(work, reference):
    """bitsandbytes' CPU backend: a 4-bit base, the adapter trained, saved and merged."""
    pytest.importorskip("bitsandbytes")
    done = run(command(work, "qlora", "peft.method=qlora", "training.max_steps=4", "checkpoint.enabled=false",
                       "peft.save_merged=true"), cwd=work, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = losses(work / "qlora")
    assert got[4] < got[1]
    # The quantization moves the losses a little from the fp32 base's, not far.
    assert all(abs(got[s] - losses(reference)[s]) < 0.05 * losses(reference)[s] for s in got)
    assert (work / "qlora" / "model" / "adapter_model.safetensors").is_file()
    assert (work / "qlora" / "merged" / "model.safetensors").is_file()


def test_qlora_under_fsdp2_in_bf16_on_two_processes_matches_one(work):
    """FSDP2's bf16 MixedPrecisionPolicy casts every float parameter on each all-gather: the
    packed 4-bit weights must already be stored in bf16 or their bytes are value-cast (this
    ended in bitsandbytes' "shape '[32, 16]' is invalid for input of size 256")."""
    pytest.importorskip("bitsandbytes")
    # No evaluation: bitsandbytes' CPU inference path for bf16 needs rows of at least 64
    # values, wider than this 32-wide model (a CPU-only limit, not the one checked here).
    qlora = ("peft.method=qlora", "precision.mixed_precision=bf16", "training.max_steps=4", "data.validation_fraction=0",
             "checkpoint.enabled=false", "checkpoint.save_final_model=false")
    one = run(command(work, "qlora-bf16", *qlora), cwd=work, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run(command(work, "qlora-fsdp2", *qlora, "parallel.strategy=fsdp", "launch.num_processes=2",
                      "training.micro_batch_size=2", f"launch.main_process_port={free_port()}"), cwd=work, timeout=900)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    expected, got = losses(work / "qlora-bf16"), losses(work / "qlora-fsdp2")
    assert sorted(got) == [1, 2, 3, 4]
    assert all(abs(got[s] - expected[s]) <= 2e-2 for s in got), (got, expected)
    assert got[4] < got[1]
