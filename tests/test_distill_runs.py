"""Distillation runs as `overdrive train` runs it: chat data (the assistant's tokens alone in the loss),
a small Llama taught by a wider one, the same losses on one process (micro 4) and on 2 processes
(ZeRO-2, micro 2) over gloo: the teacher whole on every rank beside a student a library wraps (DDP's
replicas are the same case with a plainer wrapper); the split on one process is tests/test_distill.py's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from checkpoint_probe import killed_then_resumed, records, run
from hf_fixtures import make_student_and_teacher, write_letter_chat
from strategy_probe import free_port

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill-runs")
    make_student_and_teacher(root)
    write_letter_chat(root / "chat.jsonl", 48)
    return root


def _command(work: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'student'}",
            "model.from_scratch=false", f"distill.teacher={work / 'teacher'}", "distill.temperature=2.0",
            "distill.alpha=0.5", f"data.source={work / 'chat.jsonl'}", "data.format=chat", "data.packing=false",
            "data.max_length=48", f"data.cache_dir={work / 'cache'}", f"output_dir={work / out}",
            f"training.max_steps={STEPS}", "training.log_every_steps=1", "optim.lr=1e-3", "launch.use_cpu=true",
            "precision.mixed_precision=no", "checkpoint.enabled=false", "checkpoint.save_final_model=false",
            "logging.trackers=[none]", f"launch.main_process_port={free_port()}", *extra]


def _logged(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(out) if "loss" in r}


def _train(work: Path, out: str, *extra: str, said: list | None = None) -> dict[int, dict]:
    done = run(_command(work, out, *extra), cwd=work, timeout=600)
    assert done.returncode == 0, out + done.stdout[-3000:] + done.stderr[-3000:]
    if said is not None:
        said.append(done.stdout + done.stderr)
    return _logged(work / out)


def test_one_process_ddp_zero2_fsdp2_and_zero3_give_the_same_distillation_losses(work):
    expected = _train(work, "one", "training.micro_batch_size=4", "training.gradient_accumulation_steps=1")
    first = expected[1]
    assert {"distill/loss", "distill/cross_entropy", "distill/top1_agreement"} <= set(first)
    # alpha 0.5: the step's loss is the mean of the two, per loss token of the global batch
    assert abs(first["loss"] - 0.5 * (first["distill/loss"] + first["distill/cross_entropy"])) <= 1e-5
    two = ("launch.num_processes=2", "training.micro_batch_size=2", "training.gradient_accumulation_steps=1")
    for name, extra in (("ddp", ("parallel.strategy=ddp", *two)),
                        ("zero2", ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2", *two)),
                        ("fsdp2", ("parallel.strategy=fsdp", *two)),
                        ("zero3", ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", *two))):
        said: list[str] = []
        got = _train(work, name, *extra, said=said)
        if name in ("fsdp2", "zero3"):  # the teacher sharded as the student is: no rank holds it whole
            assert "the teacher sharded as the student is" in said[0], said[0][-2000:]
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in got:
            print(name, step, got[step]["loss"], expected[step]["loss"])
            assert abs(got[step]["loss"] - expected[step]["loss"]) <= 1e-5, (name, step)
            assert abs(got[step]["distill/top1_agreement"] - expected[step]["distill/top1_agreement"]) <= 1e-9


def test_on_policy_steps_and_a_cached_teacher_run_as_train_runs_them(work):
    """lmbda 1: every step on-policy (metrics.jsonl says so); top-k: `overdrive distill-cache` once,
    then a run reads it, says the teacher is not loaded, and gets the live top-k run's losses."""
    on = _train(work, "on_policy", "distill.lmbda=1", "distill.max_new_tokens=6", "training.micro_batch_size=4")
    assert [on[s]["distill_on_policy"] for s in sorted(on)] == [1.0] * STEPS
    assert all(on[s]["timing/generation_s"] > 0 for s in on)
    top_k = ("distill.top_k=8", "training.micro_batch_size=4")
    said: list = []
    live = _train(work, "top_k_live", *top_k, said=said)
    assert "loading the teacher" in said[-1]
    done = run([sys.executable, "-m", "overdrive.cli", "distill-cache", f"model.name_or_path={work / 'student'}",
                "model.from_scratch=false", f"distill.teacher={work / 'teacher'}", "distill.top_k=8",
                f"data.source={work / 'chat.jsonl'}", "data.format=chat", "data.packing=false", "data.max_length=48",
                f"data.cache_dir={work / 'cache'}"], cwd=work, timeout=600)
    assert done.returncode == 0 and "wrote" in done.stderr, done.stderr[-3000:]
    cached = _train(work, "top_k_cached", *top_k, said=said)
    assert "the teacher is not loaded" in said[-1] and "loading the teacher" not in said[-1]
    for step in live:
        assert abs(cached[step]["loss"] - live[step]["loss"]) <= 1e-5, (step, cached[step], live[step])


def test_on_policy_with_a_sharded_student_gives_the_one_process_losses(work):
    """lmbda 1 under FSDP2 and ZeRO-3 at 2 processes and HSDP (2 replicas x 2 shards) at 4: every rank
    takes every forward of the sampling, each row is drawn with the seed of its place in the global
    batch, and the teacher is sharded over the student's mesh: the one-process run's samples and losses."""
    # up to data.max_length (48): rows of prompts of other lengths sample other numbers of tokens
    on = ("distill.lmbda=1", "distill.max_new_tokens=48", "training.gradient_accumulation_steps=1")
    expected = _train(work, "on_one", *on, "training.micro_batch_size=4")
    for name, extra in (("on_fsdp2", ("parallel.strategy=fsdp", "launch.num_processes=2",
                                      "training.micro_batch_size=2")),
                        ("on_zero3", ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                                      "launch.num_processes=2", "training.micro_batch_size=2")),
                        ("on_hsdp", ("parallel.strategy=fsdp", "parallel.dp_replicate_size=2",
                                     "parallel.dp_shard_size=2", "launch.num_processes=4",
                                     "training.micro_batch_size=1"))):
        said: list[str] = []
        got = _train(work, name, *on, *extra, said=said)
        held, total = (int(n.replace(",", "")) for n in re.search(
            r"the teacher sharded as the student is: ([\d,]+) of its ([\d,]+)", said[0]).groups())
        assert held <= 0.6 * total, (name, held, total)  # HSDP too: over the 2 ranks of a replica, not 4
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in got:
            print(name, step, got[step]["loss"], expected[step]["loss"], got[step]["loss"] - expected[step]["loss"])
            assert got[step]["distill_on_policy"] == 1.0
            assert abs(got[step]["loss"] - expected[step]["loss"]) <= 1e-5, (name, step)
            assert abs(got[step]["distill/top1_agreement"] - expected[step]["distill/top1_agreement"]) <= 1e-9


def test_a_killed_on_policy_run_resumes_exactly(work):
    """lmbda 0.5 over 8 steps, a checkpoint every 4: SIGKILLed after step 5, the resumed run tosses the
    same coins and draws the same samples from step 5 on (both from the seed and the step), so its
    losses are the uninterrupted run's to the bit."""
    run_args = ("distill.lmbda=0.5", "distill.max_new_tokens=8", "training.micro_batch_size=4",
                "training.max_steps=8", "checkpoint.enabled=true", "checkpoint.every_steps=4")
    expected = _train(work, "on_whole", *run_args)
    assert {expected[s]["distill_on_policy"] for s in expected} == {0.0, 1.0}  # both kinds of step
    out = work / "on_killed"
    killed_then_resumed(_command(work, "on_killed", *run_args), work, out, 4, 1)
    got = _logged(out)
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in expected:
        for name in ("loss", "distill/loss", "distill/cross_entropy", "distill/top1_agreement", "distill_on_policy"):
            assert got[step][name] == expected[step][name], (step, name, got[step][name], expected[step][name])
