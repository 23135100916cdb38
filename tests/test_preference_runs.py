"""Preference training run as a user types it: a 2-layer Llama with a chat template, 300
conversational pairs whose chosen answer is right (the prompt's first letter) and whose rejected
one is constant ("the answer is yes").

The one-process LoRA DPO run is the reference: it starts at ln 2, logs TRL's names, learns the
preference, and ends where TRL's own DPOTrainer ends on the same pairs and settings; DDP, ZeRO-3
and FSDP2 on 2 processes log its losses; a run killed after a checkpoint resumes exactly.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from checkpoint_probe import losses, records, run, killed_then_resumed
from hf_fixtures import make_preference_data, make_tiny_llama
from strategy_probe import REPO, free_port

pytestmark = pytest.mark.slow  # every test here starts processes and trains

STEPS = 30
TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")
RUN = ["data.format=preference", "preference.method=dpo", "data.max_length=64", "data.validation_fraction=0",
       "peft.method=lora", "peft.r=8", "peft.alpha=16", "training.micro_batch_size=8", "training.log_every_steps=1",
       "optim.lr=5e-3", "optim.weight_decay=0", "scheduler.name=constant", "scheduler.warmup_steps=0",
       "precision.mixed_precision=no", "launch.use_cpu=true", "logging.trackers=[none]", "logging.progress=false"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preference")
    make_tiny_llama(root / "base")
    make_preference_data(root / "pairs.jsonl", rows=300)
    return root


def command(work: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'base'}",
            f"data.source={work / 'pairs.jsonl'}", f"data.cache_dir={work / 'cache'}", *RUN,
            f"output_dir={work / out}", *extra]


REFERENCE = [f"training.max_steps={STEPS}", "checkpoint.every_steps=8"]


@pytest.fixture(scope="module")
def reference(work) -> Path:
    done = run(command(work, "reference", *REFERENCE), cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training: dpo on preference pairs, 30 steps" in done.stdout
    return work / "reference"


def test_lora_dpo_starts_at_ln2_logs_trls_names_and_matches_trls_dpo_trainer(work, reference):
    logged = [r for r in records(reference) if "loss" in r]
    assert abs(logged[0]["loss"] - math.log(2)) < 1e-4, logged[0]
    assert all(name in r for r in logged for name in TRL_NAMES)
    assert logged[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert logged[-1]["rewards/accuracies"] >= 0.9, logged[-1]
    ours = [r["loss"] for r in logged]
    done = run([sys.executable, str(Path(__file__).parent / "trl_dpo_probe.py"), str(work / "base"),
                str(work / "pairs.jsonl"), str(work / "trl"), "5e-3", str(STEPS)], cwd=work, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    trl = [r for r in map(json.loads, (work / "trl" / "trl_log.jsonl").read_text().splitlines()) if "loss" in r]
    theirs = [float(r["loss"]) for r in trl]
    assert len(theirs) == STEPS and abs(theirs[0] - math.log(2)) < 1e-4
    mean_ours, mean_theirs = sum(ours[-10:]) / 10, sum(theirs[-10:]) / 10
    print("step overdrive TRL\n" + "\n".join(f"{i + 1} {a:.4f} {b:.4f}" for i, (a, b) in enumerate(zip(ours, theirs))))
    assert abs(mean_ours - mean_theirs) <= 0.15 * mean_theirs, (mean_ours, mean_theirs)


def test_two_processes_under_zero3_and_fsdp2_match_one(work, reference):
    """The preference objective under the two engines that shard the policy (DDP's plain replicas
    are the loss normalisation tests')."""
    expected = losses(reference)
    strategies = {"zero3": "configs/zero3.yaml", "fsdp2": "configs/fsdp.yaml"}
    table = {}
    for name, config in strategies.items():
        done = run(command(work, name, str(REPO / config), "training.max_steps=3", "launch.num_processes=2",
                           "training.micro_batch_size=4", "precision.mixed_precision=no", "checkpoint.enabled=false",
                           f"launch.main_process_port={free_port()}"), cwd=work, timeout=900)
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-3000:]
        got = {r["step"]: r for r in records(work / name) if "loss" in r}
        table[name] = [round(got[s]["loss"], 6) for s in sorted(got)]
        assert sorted(got) == [1, 2, 3]
        for step, record in got.items():
            assert abs(record["loss"] - expected[step]) <= 1e-3 * abs(expected[step]), (name, step, record)
            assert record["rewards/accuracies"] == pytest.approx(
                next(r for r in records(reference) if r.get("step") == step and "loss" in r)["rewards/accuracies"])
    print(table)


def test_a_killed_dpo_run_resumes_exactly(work, reference):
    out = work / "killed"
    killed_then_resumed(command(work, "killed", *REFERENCE), work, out, 8, 2, timeout=600)
    assert losses(out) == losses(reference)
    mine = {r["step"]: r["rewards/margins"] for r in records(out) if "loss" in r}
    assert mine == {r["step"]: r["rewards/margins"] for r in records(reference) if "loss" in r}


def test_full_parameter_dpo_with_a_frozen_copy_equals_precomputed_reference_also_sharded(work):
    """The precomputed reference under FSDP2 on 2 processes: each rank scores its share of the
    pairs in lock step with the sharded policy, and the losses are the one-process frozen copy's."""
    got = {}
    sharded = (str(REPO / "configs/fsdp.yaml"), "launch.num_processes=2", "training.micro_batch_size=4",
               "preference.precompute_reference=true", f"launch.main_process_port={free_port()}")
    for name, extra in (("copy", ()), ("precomputed", ("preference.precompute_reference=true",)),
                        ("fsdp2-precomputed", sharded)):
        done = run(command(work, name, "peft.method=none", "training.max_steps=3", "checkpoint.enabled=false",
                           "checkpoint.save_final_model=false", *extra), cwd=work, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        got[name] = [(r["loss"], r["rewards/margins"]) for r in records(work / name) if "loss" in r]
    assert got["copy"] == got["precomputed"]
    for (loss, margin), (sharded_loss, sharded_margin) in zip(got["copy"], got["fsdp2-precomputed"]):
        assert abs(sharded_loss - loss) <= 1e-3 * loss and abs(sharded_margin - margin) <= 1e-3 * max(margin, 1e-3)
    assert (work / "precomputed" / "reference_logps.pt").is_file()
    assert got["copy"][0][0] == pytest.approx(math.log(2), abs=1e-4) and got["copy"][-1][0] < got["copy"][0][0]


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_orpo_and_simpo_train(work, method):
    done = run(command(work, method, f"preference.method={method}", "training.max_steps=4",
                       "checkpoint.enabled=false", "checkpoint.save_final_model=false",
                       *(["preference.beta=2.0"] if method == "simpo" else [])), cwd=work, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [r for r in records(work / method) if "loss" in r]
    assert len(logged) == 4 and logged[-1]["loss"] < logged[0]["loss"]
    assert all(name in logged[-1] for name in TRL_NAMES)


def test_a_reward_model_learns_to_rank_the_pairs(work):
    done = run(command(work, "reward", "preference.method=reward", "model.task=sequence-classification",
                       "training.max_steps=20", "training.log_every_steps=5", "checkpoint.enabled=false",
                       "checkpoint.save_final_model=false"), cwd=work, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [r for r in records(work / "reward") if "loss" in r]
    assert logged[-1]["loss"] < 0.5 * logged[0]["loss"] and logged[-1]["accuracy"] >= 0.9, logged[-1]
    assert all(name in logged[-1] for name in ("rewards/margins", "accuracy", "margin", "mean_reward"))


def test_a_negative_beta_and_a_missing_chosen_column_exit_2_by_key(work):
    done = run(command(work, "bad", "preference.beta=-0.1"), cwd=work, timeout=300)
    assert done.returncode == 2 and "preference.beta" in done.stderr and "Traceback" not in done.stderr
    done = run(command(work, "bad", "data.chosen_column=better", "training.max_steps=1"), cwd=work, timeout=300)
    assert done.returncode == 2 and "data.chosen_column" in done.stderr and "Traceback" not in done.stderr
    assert "'better'" in done.stderr
