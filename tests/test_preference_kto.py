"""KTO (`preference.method: kto`) as TRL's KTOTrainer computes it: the loss of one batch against
TRL's own `compute_loss`, the batch against its collator, the rows as it renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_fixtures import LETTERS, make_tiny_llama
from overdrive.errors import UserError
from overdrive.resolving import resolve


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kto")
    return make_tiny_llama(root / "policy"), make_tiny_llama(root / "reference", seed=1)


def _rows(n: int = 8) -> list[dict]:
    rows = []
    for i in range(n):
        prompt = " ".join(LETTERS[(i + k) % 26] for k in range(3 + i % 3))
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "completion": [{"role": "assistant", "content": f"the answer is {LETTERS[i]}" + " ok" * (i % 2)}],
                     "label": i % 3 != 0})
    return rows


def _cfg(policy: Path, source: Path, *items: str):
    return resolve((), cli=[f"model.name_or_path={policy}", f"data.source={source}", "data.format=preference",
                            "preference.method=kto", "training.micro_batch_size=4", *items], env={}).config


@pytest.mark.slow
def test_kto_loss_of_one_batch_equals_trls_kto_trainer(models, tmp_path):
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from overdrive.data.preference_unpaired import UnpairedCollator
    from overdrive.training.objectives.preference import PreferenceObjective, frozen_reference

    policy_dir, reference_dir = models
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy, reference = (AutoModelForCausalLM.from_pretrained(d) for d in models)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to="none", max_length=64,
                     use_cpu=True, beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)
    trainer = KTOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(_rows()),
                         processing_class=tokenizer)
    rows = [trainer.train_dataset[i] for i in range(4)]
    trl_batch = trainer.data_collator(rows)
    with torch.no_grad():
        want = trainer.compute_loss(trainer.model, trl_batch)

    # Our collator, from the same token ids: TRL's sequences, completion masks and KL rotation.
    ours = UnpairedCollator(tokenizer.pad_token_id, 64)([
        {"prompt_ids": torch.tensor(r["prompt_ids"]), "completion_ids": torch.tensor(r["completion_ids"]),
         "desirable": torch.tensor(r["label"])} for r in rows])
    for prefix, trl_prefix in (("", ""), ("kl_", "KL_")):
        assert torch.equal(ours[f"{prefix}input_ids"], trl_batch[f"{trl_prefix}input_ids"])
        assert torch.equal(ours[f"{prefix}attention_mask"], trl_batch[f"{trl_prefix}attention_mask"])
        completion = trl_batch[f"{trl_prefix}completion_mask"].bool()
        assert torch.equal(ours[f"{prefix}labels"], trl_batch[f"{trl_prefix}input_ids"].masked_fill(~completion, -100))
    assert torch.equal(ours["desirable"], trl_batch["label"].bool())

    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cfg = _cfg(policy_dir, source, "preference.beta=0.2", "preference.desirable_weight=1.3",
               "preference.undesirable_weight=0.7", "peft.method=none")
    accelerator = Accelerator(cpu=True)
    objective = PreferenceObjective(cfg, accelerator, frozen_reference(reference, accelerator))
    with torch.no_grad():  # the micro-batch's summed loss over its rows (its units), as the step takes it
        got = objective.sums(trainer.model, ours) / objective.counts(ours)
    print(f"KTO loss: overdrive {got.item():.8f}  TRL {want.item():.8f}")
    assert abs(got.item() - want.item()) < 1e-5 and abs(want.item() - 0.5) > 1e-3  # the reference differs: not 0.5
    metrics = objective.read()
    assert metrics["kl"] >= 0 and set(metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/margins", "kl"}
    assert objective.counts(ours).tolist() == [4]


def test_kto_rows_are_rendered_as_trls_kto_trainer_renders_them(models, tmp_path):
    from transformers import AutoTokenizer
    from trl.data_utils import _tokenize, common_prefix_length

    from overdrive.data.preference_unpaired import DESIRABLE, UNDESIRABLE, UnpairedEncoder, UnpairedRows

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    encoder = UnpairedEncoder(tokenizer, max_length=64)
    for row in _rows(3) + [{"prompt": "a b ", "completion": "the answer", "label": False}]:
        if isinstance(row["prompt"], list):
            prompt = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True)["input_ids"]
            full = _tokenize(tokenizer, row["prompt"] + row["completion"])["input_ids"]
        else:  # TRL's add_eos, then the text tokenized
            prompt = _tokenize(tokenizer, row["prompt"])["input_ids"]
            full = _tokenize(tokenizer, row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]
        n = common_prefix_length(prompt, full)
        assert encoder.render({**row, "desirable": row["label"]}) == (prompt[:n], full[n:])
        ids, mask = encoder.encode({**row, "desirable": row["label"]})
        label = DESIRABLE if row["label"] else UNDESIRABLE
        assert ids == prompt[:n] + full[n:] and mask == [0] * n + [label] * (len(full) - n)
        import numpy as np

        back = UnpairedRows(np.asarray(ids), np.asarray([len(ids)]), np.asarray(mask, dtype=np.uint8))[0]
        assert back["prompt_ids"].tolist() == prompt[:n] and bool(back["desirable"]) == row["label"]
    assert UnpairedEncoder(tokenizer, max_length=2).encode({**_rows(1)[0], "desirable": True}) is None


def test_kto_reads_unpaired_rows_llamafactory_conversations_and_splits_pairs(models, tmp_path):
    from overdrive.data.opening import open_splits

    policy = models[0]
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text("".join(json.dumps(r) + "\n" for r in _rows(4)))
    first = next(open_splits(_cfg(policy, unpaired)).train.batches()).texts[0]
    assert first == [{"prompt": _rows(1)[0]["prompt"], "completion": _rows(1)[0]["completion"], "desirable": False}]
    factory = tmp_path / "kto_en_demo.json"  # LLaMA-Factory's kto_en_demo: messages + label
    factory.write_text(json.dumps([{"messages": [{"role": "user", "content": "a b"},
                                                 {"role": "assistant", "content": "the answer"}], "label": True}]))
    first = next(open_splits(_cfg(policy, factory)).train.batches()).texts[0]
    assert first == [{"prompt": [{"role": "user", "content": "a b"}],
                      "completion": [{"role": "assistant", "content": "the answer"}], "desirable": True}]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a b ", "chosen": "yes", "rejected": "no"}) + "\n")
    first = next(open_splits(_cfg(policy, pairs)).train.batches()).texts[0]
    assert [(r["completion"], r["desirable"]) for r in first] == [("yes", True), ("no", False)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b", "label": "maybe"}) + "\n")
    with pytest.raises(UserError) as error:
        list(open_splits(_cfg(policy, bad)).train.batches())
    assert error.value.problems[0].key == "data.label_column" and "line 1" in error.value.render()


def test_kto_rules(models, tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _rows(4)))
    with pytest.raises(UserError) as error:  # the KL term needs other rows in the micro-batch
        _cfg(models[0], source, "training.micro_batch_size=1", "peft.method=lora")
    assert [p.key for p in error.value.problems] == ["training.micro_batch_size"]
    with pytest.raises(UserError) as error:
        _cfg(models[0], source, "peft.method=lora", "preference.precompute_reference=true")
    assert "preference.precompute_reference" in [p.key for p in error.value.problems]
    cfg = _cfg(models[0], source, "peft.method=lora", "preference.desirable_weight=1.5")
    assert (cfg.preference.method, cfg.preference.desirable_weight) == ("kto", 1.5)


@pytest.mark.slow
def test_a_kto_run_raises_the_desirable_undesirable_reward_gap(tmp_path):
    """300 pairs split into 600 rows: the right answer desirable, the constant one not; LoRA, 30 steps."""
    import sys

    from checkpoint_probe import records, run
    from hf_fixtures import make_preference_data

    make_tiny_llama(tmp_path / "base")
    make_preference_data(tmp_path / "pairs.jsonl", rows=300)
    done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={tmp_path / 'base'}",
                f"data.source={tmp_path / 'pairs.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
                "data.format=preference", "preference.method=kto", "data.max_length=64", "data.validation_fraction=0",
                "peft.method=lora", "peft.r=8", "peft.alpha=16", "training.micro_batch_size=8", "training.max_steps=30",
                "training.log_every_steps=1", "optim.lr=5e-3", "optim.weight_decay=0", "scheduler.name=constant",
                "scheduler.warmup_steps=0", "precision.mixed_precision=no", "launch.use_cpu=true",
                "logging.trackers=[none]", "logging.progress=false", f"output_dir={tmp_path / 'out'}"],
               cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "training: kto on desirable and undesirable completions, 30 steps" in said
    assert "rewards/margins 0.0000 -> " in said  # the final lines: the gap from the first log point to the last
    logged = [r for r in records(tmp_path / "out") if "loss" in r]
    assert abs(logged[0]["loss"] - 0.5) < 1e-4 and logged[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    print("step loss rewards/margins kl\n" + "\n".join(f"{r['step']} {r['loss']:.4f} {r['rewards/margins']:.4f} "
                                                         f"{r['kl']:.4f}" for r in logged))
    late = [r["rewards/margins"] for r in logged[-10:]]
    assert sum(late) / len(late) > 0.05, late  # desirable completions gain on undesirable ones
    assert all("kl" in r and r["kl"] >= 0 for r in logged)


@pytest.mark.slow
def test_kto_under_zero3_on_two_processes(tmp_path):
    """The one-process run (micro-batch 4, accumulation 2) against 2 processes of micro-batch 4: the
    same global batch. Each micro-batch builds its own KL pairs (as TRL's per-device batches do) and
    the estimate is averaged over the ranks, so the losses agree closely, not exactly. ZeRO-3 only:
    the objective is a piece apart from the strategy, and the preference objective under DDP, ZeRO-3
    and FSDP2 is test_preference_runs' (DPO); here, KTO's KL estimate across ranks."""
    import sys

    from checkpoint_probe import records, run
    from hf_fixtures import make_preference_data
    from strategy_probe import REPO, free_port

    make_tiny_llama(tmp_path / "base")
    make_preference_data(tmp_path / "pairs.jsonl", rows=64)
    common = [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={tmp_path / 'base'}",
              f"data.source={tmp_path / 'pairs.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
              "data.format=preference", "preference.method=kto", "data.max_length=64", "data.validation_fraction=0",
              "peft.method=lora", "training.micro_batch_size=4", "training.max_steps=3", "optim.lr=5e-3",
              "scheduler.name=constant", "scheduler.warmup_steps=0", "precision.mixed_precision=no",
              "checkpoint.enabled=false", "logging.trackers=[none]", "logging.progress=false", "launch.use_cpu=true"]

    def losses(name: str, *extra: str) -> list[float]:
        done = run(common + [f"output_dir={tmp_path / name}", *extra], cwd=tmp_path, timeout=900)
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-3000:]
        return [r["loss"] for r in records(tmp_path / name) if "loss" in r]

    expected = losses("one", "training.gradient_accumulation_steps=2")
    assert len(expected) == 3 and abs(expected[0] - 0.5) < 1e-6  # the policy is its reference at step 1
    for name, config in {"zero3": "configs/zero3.yaml"}.items():
        got = losses(name, str(REPO / config), "launch.num_processes=2", f"launch.main_process_port={free_port()}")
        print(name, [round(v, 6) for v in got], "one process:", [round(v, 6) for v in expected])
        assert len(got) == 3 and got[0] == pytest.approx(0.5, abs=1e-6), (name, got)
        assert got == pytest.approx(expected, abs=5e-3), (name, got, expected)


def test_a_method_overdrive_lacks_is_refused_once_by_its_key(models, tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _rows(4)))
    with pytest.raises(UserError) as error:
        _cfg(models[0], source, "preference.method=cpo")
    assert [p.key for p in error.value.problems] == ["preference.method"]
    assert "no preference method is set" not in error.value.render() and "'kto'" in error.value.render()
