"""A long run that looks after itself: an out-of-memory step redone at half the micro-batch
(training.oom_retry), a loss spike skipped (training.loss_spike), both on two CPU processes
with the OVERDRIVE_FAULT_INJECT test hooks; the rules and hooks themselves without processes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoint_probe import command, losses, records, run, warm_cache
from conftest import free_port

from overdrive.config.fault_injection import Injection, parse
from overdrive.config.schema import RunConfig
from overdrive.config.stored import CONFIG_VERSION
from overdrive.errors import UserError
from overdrive.resolving.validate_resilience import resilience_rules
from overdrive.training.guards.oom_retry import smaller_split

# No dropout: runs of different splits are compared loss for loss.
RUN = ["model.architecture.resid_pdrop=0", "model.architecture.embd_pdrop=0", "model.architecture.attn_pdrop=0",
       "data.max_bytes=60000", "optim.lr=1e-2", "scheduler.warmup_steps=0", "training.eval_every_steps=null",
       "launch.num_processes=2"]


# ---------------------------------------------------------------- without processes

def test_the_injection_hook_is_read_and_refused_by_name():
    assert parse("oom:step=3:rank=1,spike:step=6") == Injection(oom_step=3, oom_rank=1, spike_step=6)
    assert parse("") == Injection()
    assert parse("oom-sampling:step=2:rank=1") == Injection(sampling_oom_step=2, sampling_oom_rank=1)
    for bad in ("oom:rank=1", "melt:step=2", "spike:step=x", "spike:step=0", "oom:step=2:node=1"):
        with pytest.raises(UserError, match="OVERDRIVE_FAULT_INJECT"):
            parse(bad)


def test_the_smaller_split_keeps_the_samples_per_step():
    assert smaller_split(8, 1) == (4, 2)
    assert smaller_split(3, 2) == (1, 6)
    assert smaller_split(6, 1) == (3, 2)
    assert smaller_split(1, 4) is None


def test_the_features_are_refused_where_they_cannot_work():
    def problems(**values):
        cfg = RunConfig.model_validate(values)
        errors, warnings = resilience_rules(cfg, lambda key: "")
        return [p.key for p in errors], [p.key for p in warnings]

    assert problems(training={"oom_retry": True}) == ([], [])
    assert problems(training={"oom_retry": True}, parallel={"strategy": "fsdp"})[0] == ["training.oom_retry"]
    assert problems(training={"loss_spike": {"factor": 2}}, parallel={"strategy": "deepspeed"})[0] == [
        "training.loss_spike.factor"]
    assert problems(training={"loss_spike": {"factor": 2}}, precision={"mixed_precision": "fp16"})[0] == [
        "training.loss_spike.factor"]
    assert problems(checkpoint={"async": True})[0] == ["checkpoint.async"]  # refused: it would change nothing
    assert problems(checkpoint={"async": True}, parallel={"strategy": "fsdp"}) == ([], [])


def test_each_objective_says_what_a_spike_is_measured_by_and_what_a_bad_batch_of_it_is():
    from types import SimpleNamespace

    from overdrive.training.objectives.grpo import GRPOObjective
    from overdrive.training.objectives.moe import BalancedObjective
    from overdrive.training.objectives.objective import TokenObjective
    from overdrive.training.objectives.preference import PreferenceObjective

    assert TokenObjective("causal-lm").spike_measure == "loss"
    assert PreferenceObjective.spike_measure == GRPOObjective.spike_measure == "grad_norm"
    balanced = BalancedObjective(GRPOObjective.__new__(GRPOObjective), SimpleNamespace(), None, 1)
    assert balanced.spike_measure == "grad_norm"  # a mixture of experts measures as its objective does

    rng = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    ids = torch.arange(1, 13).view(2, 6)
    labels = torch.tensor([[-100, -100, 3, 4, 5, 6], [-100, 8, 9, 10, -100, -100]])
    tokens = TokenObjective("causal-lm").corrupt({"input_ids": ids, "labels": labels}, rng())["labels"]
    assert torch.equal(tokens == -100, labels == -100) and not torch.equal(tokens, labels)
    classes = torch.tensor([0, 2, 1, 2])
    flipped = TokenObjective("sequence-classification").corrupt({"input_ids": ids, "labels": classes}, rng())["labels"]
    assert bool((flipped != classes).all()) and int(flipped.max()) <= 2 and int(flipped.min()) >= 0
    pairs = PreferenceObjective.corrupt(None, {"input_ids": ids, "labels": labels}, rng())
    answer = labels != -100
    assert torch.equal(pairs["input_ids"][~answer], ids[~answer]) and not torch.equal(pairs["input_ids"], ids)
    advantages = torch.tensor([0.5, -0.5, 0.0, 0.0])
    broken = GRPOObjective.corrupt(None, {"advantages": advantages}, rng())["advantages"]
    assert broken.abs().mean() > 10 * advantages.abs().mean()


def test_a_spike_is_judged_against_a_positive_mean_once_the_window_is_full():
    from types import SimpleNamespace

    from overdrive.training.guards.loss_spikes import LossSpikes

    cfg = RunConfig.model_validate({"training": {"loss_spike": {"factor": 2, "window": 2}}})
    state = SimpleNamespace(loss_window=None, spikes_in_a_row=0, step=0)
    spikes = LossSpikes(cfg, SimpleNamespace(device=torch.device("cpu")), state, Injection(), 1, measure="grad_norm")
    assert spikes.needs_norm
    # 5.0 after (-0.3, 0.2): a mean below zero is no scale, so not judged; 3.0 after (1.0, 1.0) is a spike.
    assert [spikes._judge(v) for v in (-0.3, 0.2, 5.0, 1.0, 1.0, 3.0)] == [False] * 5 + [True]
    assert state.spikes_in_a_row == 1 and "gradient norm 3 is 3.0 x the mean" in spikes.note
    assert not spikes._judge(float("nan")) and state.loss_window == [1.0, 1.0]
    assert not spikes._judge(1.5) and state.spikes_in_a_row == 0


# ---------------------------------------------------------------- two processes

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    one = [r for r in RUN if "num_processes" not in r] + ["launch.threads_per_process=1"]
    return warm_cache(tmp_path_factory.mktemp("long-run-cache"), one)


def train(out, cache, *extra, inject: str = ""):
    env = {**os.environ, "OVERDRIVE_FAULT_INJECT": inject} if inject else None
    args = command(out, cache, *RUN, f"launch.main_process_port={free_port()}", *extra)
    proc = run(args, cwd=out.parent) if env is None else _run_with(args, out.parent, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _run_with(args, cwd, env):
    import subprocess

    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_an_out_of_memory_step_is_redone_at_half_the_micro_batch(tmp_path, cache):
    proc = train(tmp_path / "oom", cache, "training.micro_batch_size=4", "training.max_steps=5",
                 "training.oom_retry=true", inject="oom:step=3:rank=1")
    train(tmp_path / "half", cache, "training.micro_batch_size=2", "training.gradient_accumulation_steps=2",
          "training.max_steps=5")
    assert "step 3: out of memory at micro-batch 4; redoing it at micro-batch 2 x accumulation 2" in proc.stdout
    retried, half = losses(tmp_path / "oom"), losses(tmp_path / "half")
    assert sorted(retried) == [1, 2, 3, 4, 5]  # step 3 logged once, redone
    for step in (3, 4, 5):  # every step from the redone one on: the run started at micro-batch 2
        assert abs(retried[step] - half[step]) <= 1e-6 * abs(half[step]), (step, retried[step], half[step])
    events = [r for r in records(tmp_path / "oom") if "oom_retry" in r]
    assert [(e["step"], e["micro_batch_size"], e["gradient_accumulation_steps"]) for e in events] == [(3, 2, 2)]
    logged = {r["step"]: r for r in records(tmp_path / "oom") if "loss" in r}
    assert [logged[s]["micro_batch_size"] for s in (1, 2, 3, 4, 5)] == [4, 4, 2, 2, 2]
    resolved = json.loads((tmp_path / "oom" / "resolved.json").read_text())
    assert resolved["config"]["training"]["micro_batch_size"] == 2
    assert str(resolved["origins"]["training.micro_batch_size"]).startswith("oom_retry")
    saved = json.loads((tmp_path / "oom" / "checkpoints" / "step-00000005" / "trainer_state.json").read_text())
    assert (saved["micro_batch_size"], saved["gradient_accumulation_steps"]) == (2, 2)
    assert saved["config_version"] == resolved["config_version"] == CONFIG_VERSION  # read back by config/stored.py

    # The split that fit resumes: the same command, two more steps (--force: the run had finished), at micro-batch 2.
    proc = train(tmp_path / "oom", cache, "training.micro_batch_size=4", "training.max_steps=7",
                 "training.oom_retry=true", "--force")
    assert "resuming at micro-batch 2 x accumulation 2" in proc.stdout
    assert [r["micro_batch_size"] for r in records(tmp_path / "oom") if r.get("step") in (6, 7) and "loss" in r] == [2, 2]


@pytest.mark.slow
def test_out_of_memory_without_the_retry_ends_the_run_by_key_with_its_last_checkpoint(tmp_path, cache, monkeypatch):
    """The hook fires with training.oom_retry off too: exit 2, the key and the fix said, no traceback,
    the checkpoint of the step before the failed one whole."""
    from overdrive.checkpoint import store

    monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "oom:step=3:rank=0")
    out = tmp_path / "run"
    proc = run(command(out, cache, *RUN, "launch.num_processes=1", "training.micro_batch_size=4",
                       "training.max_steps=5", "checkpoint.every_steps=1"), cwd=tmp_path)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert "training.oom_retry: step 3 ran out of memory at micro-batch 4" in said and "training.oom_retry=true" in said
    assert "Traceback" not in said and "internal error" not in said
    root = out / "checkpoints"
    assert store.latest_complete(root).found.step == 2 and store.verify(root / "step-00000002").ok
    assert sorted(losses(out)) == [1, 2]


@pytest.mark.slow
def test_a_loss_spike_is_skipped_on_every_rank(tmp_path, cache):
    # A tiny model from scratch: its loss falls a few percent in four steps, and scrambled labels
    # put it back near ln(vocabulary), 5% above the mean of the two steps before (measured).
    spike = ["training.loss_spike.factor=1.03", "training.loss_spike.window=2", "training.micro_batch_size=4",
             "scheduler.name=constant"]  # the same lr at every step, however long the run
    proc = train(tmp_path / "spike", cache, *spike, "training.max_steps=6", "checkpoint.every_steps=5",
                 inject="spike:step=5")
    train(tmp_path / "clean", cache, *spike, "training.max_steps=4")
    assert "step 5: loss" in proc.stdout and "skipped, the weights untouched" in proc.stdout
    logged = {r["step"]: r for r in records(tmp_path / "spike") if "loss" in r}
    assert [logged[s]["loss_spikes_skipped"] for s in range(1, 7)] == [0, 0, 0, 0, 1, 0]

    # Step 5 changed nothing: its checkpoint holds the weights and optimizer state of a run that
    # stopped after step 4, and the data position moved past the scrambled batch.
    from safetensors.torch import load_file

    spiked = tmp_path / "spike" / "checkpoints" / "step-00000005"
    clean = tmp_path / "clean" / "checkpoints" / "step-00000004"
    a, b = load_file(str(spiked / "model.safetensors")), load_file(str(clean / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = (torch.load(p / "optimizer.bin", weights_only=False) for p in (spiked, clean))
    for index, values in opt_b["state"].items():
        assert all(torch.equal(values[k], opt_a["state"][index][k]) for k in values)
    state_a, state_b = (json.loads((p / "trainer_state.json").read_text()) for p in (spiked, clean))
    assert state_a["samples_in_epoch"] == state_b["samples_in_epoch"] + 2 * 4  # one global batch further
    assert logged[6]["loss"] < logged[4]["loss"]  # and training went on


# ---------------------------------------------------------------- checkpoint.async (FSDP2: saves through DCP)

FSDP = ["parallel.strategy=fsdp", "checkpoint.every_steps=2", "training.micro_batch_size=4"]


def blocked_seconds(stdout: str) -> list[float]:
    import re

    return [float(s) for s in re.findall(r"training blocked ([0-9.]+) s", stdout)]


@pytest.mark.slow
@pytest.mark.alone  # two timings compared
def test_async_checkpoints_block_training_a_fraction_of_a_synchronous_save(tmp_path, cache):
    # A model whose checkpoint is 330 MB (weights and two Adam moments): the write, not the fixed
    # cost of a save, is what a background save takes off the training thread. Saves 4 steps apart:
    # the first is written before the second begins (else the second waits for it, and says so).
    # One thread per process: two ranks and the writers share two cores.
    wide = ["model.architecture.n_layer=4", "model.architecture.n_embd=768", "model.architecture.n_head=8",
            "optim.lr=1e-3", "training.max_steps=8", "checkpoint.every_steps=4", "training.micro_batch_size=2",
            "launch.threads_per_process=1"]
    synchronous = train(tmp_path / "sync", cache, *FSDP, *wide)
    background = train(tmp_path / "async", cache, *FSDP, *wide, "checkpoint.async=true")
    waited, staged = blocked_seconds(synchronous.stdout), blocked_seconds(background.stdout)
    assert len(waited) == len(staged) == 2 and "written in the background" in background.stdout
    # Measured on an idle machine 0.22-0.36 s against 2.1-3.3 s (docs/checkpoints.md); beside other
    # jobs on two cores the ratio has reached 0.5. A save that waited for its write would be near 1.
    print(f"training blocked {sum(staged):.2f} s in background saves, {sum(waited):.2f} s in synchronous ones")
    assert sum(staged) < 0.8 * sum(waited), (staged, waited, background.stdout[-3000:])
    for step in (4, 8):
        assert (tmp_path / "async" / "checkpoints" / f"step-{step:08d}" / "manifest.json").exists()


@pytest.mark.slow
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, cache):
    from checkpoint_probe import kill_group, wait_for

    from overdrive.checkpoint import store

    steps = ["training.max_steps=6"]
    out = tmp_path / "run"
    args = command(out, cache, *RUN, f"launch.main_process_port={free_port()}", *FSDP, *steps, "checkpoint.async=true")
    proc = start_with(args, tmp_path, {**os.environ, "OVERDRIVE_FAULT_INJECT": "stall:step=4"})
    tmp = out / "checkpoints" / ".tmp-step-00000004"
    written = lambda: all((tmp / part / ".metadata").exists() for part in ("pytorch_model_fsdp_0", "optimizer_0"))  # noqa: E731
    wait_for(written, proc, what="step 4's checkpoint written in the background")
    kill_group(proc)  # the whole job, as losing the machine would, before step 4's checkpoint is sealed
    proc.communicate()
    reference = losses(out)  # the uninterrupted run up to the kill: steps 1-4 at least (step 4 is logged, then saved)
    assert max(reference) >= 4
    root = out / "checkpoints"
    assert store.verify(root / "step-00000002").ok and not (root / "step-00000004").exists()
    assert store.latest_complete(root).found.step == 2

    resumed = train(out, cache, *FSDP, *steps, "checkpoint.async=true")
    assert "resumed from" in resumed.stdout and "step-00000002" in resumed.stdout
    after = losses(out)
    assert sorted(after) == list(range(1, 7))
    for step in range(3, max(reference) + 1):  # resumed from an async checkpoint: the uninterrupted losses
        assert abs(after[step] - reference[step]) <= 1e-6 * abs(reference[step]), (step, after[step], reference[step])
    assert store.verify(root / "step-00000006").ok


def start_with(args, cwd, env):
    import subprocess

    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


@pytest.mark.slow
def test_spikes_in_a_row_stop_the_run_with_the_weights_from_before(tmp_path, monkeypatch):
    """One process: max_in_a_row=1 stops at the first spike, its checkpoint untouched by it."""
    from safetensors.torch import load_file

    from overdrive.training import loop as trainer

    def config(out, steps):
        return RunConfig.model_validate({
            "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                                       "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
            "tokenizer": {"vocab_size": 512}, "optim": {"lr": 1e-2}, "scheduler": {"name": "constant", "warmup_steps": 0},
            "data": {"max_bytes": 60000, "max_length": 32, "cache_dir": str(tmp_path / "cache"),
                     "validation_fraction": 0.0},
            "training": {"micro_batch_size": 8, "max_steps": steps, "log_every_steps": 1, "eval_every_steps": None,
                         "loss_spike": {"factor": 1.02, "window": 2, "max_in_a_row": 1}},
            "checkpoint": {"save_final_model": False},
            "logging": {"trackers": ["none"], "progress": False, "level": "quiet"}, "output_dir": str(out)})

    trainer.train(config(tmp_path / "warm", 1))  # the caches filled: both runs below draw the same RNG
    trainer.train(config(tmp_path / "clean", 4))
    monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "spike:step=5")
    result = trainer.train(config(tmp_path / "run", 8))
    assert result.steps == 5 and "1 loss spikes in a row up to step 5" in result.stopped_early
    before = load_file(str(tmp_path / "clean" / "checkpoints" / "step-00000004" / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "checkpoints" / "step-00000005" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_out_of_memory_at_micro_batch_one_ends_the_run_by_key(tmp_path, monkeypatch):
    from overdrive.training import loop as trainer

    cfg = RunConfig.model_validate({
        "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64}},
        "tokenizer": {"vocab_size": 512},
        "data": {"max_bytes": 20000, "max_length": 32, "cache_dir": str(tmp_path / "cache"), "validation_fraction": 0.0},
        "training": {"micro_batch_size": 1, "max_steps": 3, "eval_every_steps": None, "oom_retry": True},
        "checkpoint": {"save_final_model": False},
        "logging": {"trackers": ["none"], "progress": False, "level": "quiet"}, "output_dir": str(tmp_path / "run")})
    monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "oom:step=2:rank=0")
    with pytest.raises(UserError) as caught:
        trainer.train(cfg)
    assert caught.value.problems[0].key == "training.micro_batch_size"
    assert "step 2 ran out of memory at micro-batch 1" in caught.value.problems[0].message
