"""Checkpoint mechanics without training: atomic directories, manifests, finding the newest
complete checkpoint, pruning, config comparison, the non-finite guard and the stop signal."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from overdrive.training.guards import nonfinite
from overdrive.checkpoint import fingerprint as fp
from overdrive.checkpoint import session, store
from overdrive.checkpoint.signals import StopRequest
from overdrive.config.schema import RunConfig
from overdrive.config.stored import read_stored
from overdrive.errors import UserError


def save_fake(root, step, files=None, lineage="run-a"):
    """A checkpoint as session.save leaves it: files in a temp dir, committed."""
    tmp = store.begin(root, step)
    for name, data in (files or {"model.safetensors": b"w" * 100, "sub/optimizer.bin": b"o" * 50}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    (tmp / session.TRAINER_STATE).write_text(json.dumps({"lineage": lineage, "step": step}))
    return store.commit(tmp, step)


# ---------------------------------------------------------------- store

def test_commit_is_a_rename_of_a_sealed_directory(tmp_path):
    final = save_fake(tmp_path, 100)
    assert final.name == "step-00000100" and not (tmp_path / ".tmp-step-00000100").exists()
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == 100
    assert set(manifest["files"]) == {"model.safetensors", "sub/optimizer.bin", "trainer_state.json"}
    assert manifest["files"]["model.safetensors"]["size"] == 100
    assert store.verify(final).ok


def test_an_interrupted_save_is_never_taken_for_a_checkpoint(tmp_path):
    save_fake(tmp_path, 10)
    # Killed while writing: only the temp dir exists, with part of the files.
    tmp = store.begin(tmp_path, 20)
    (tmp / "model.safetensors").write_bytes(b"partial")
    # A directory with the final name but no manifest (e.g. copied by hand, half-way).
    (tmp_path / "step-00000030").mkdir()
    (tmp_path / "step-00000030" / "model.safetensors").write_bytes(b"x")
    search = store.latest_complete(tmp_path)
    assert search.found.step == 10
    assert [v.step for v in search.skipped] == [30] and "no manifest" in search.skipped[0].reason
    # A new save of step 20 replaces the stale temp dir instead of mixing into it.
    final = save_fake(tmp_path, 20)
    assert store.verify(final).ok and not (final / "partial").exists()


def test_truncated_and_corrupted_files_are_detected(tmp_path):
    save_fake(tmp_path, 1)
    truncated = save_fake(tmp_path, 2)
    corrupted = save_fake(tmp_path, 3)
    with (truncated / "model.safetensors").open("r+b") as f:
        f.truncate(10)
    data = bytearray((corrupted / "sub" / "optimizer.bin").read_bytes())
    data[5] ^= 0xFF  # same size, different content
    (corrupted / "sub" / "optimizer.bin").write_bytes(bytes(data))
    # Sizes alone (the cheap check every rank makes) catch truncation, not a flipped byte.
    assert store.latest_complete(tmp_path, checksums=False).found.step == 3
    search = store.latest_complete(tmp_path, checksums=True)
    assert search.found.step == 1
    reasons = {v.step: v.reason for v in search.skipped}
    assert "sha256" in reasons[3] and "10 bytes" in reasons[2]
    assert store.latest_complete(tmp_path, at_most=1).found.step == 1
    (tmp_path / "step-00000001" / "manifest.json").write_text("{not json")
    assert store.latest_complete(tmp_path).found is None


def test_commit_over_an_existing_directory_keeps_one_complete_at_all_times(tmp_path):
    save_fake(tmp_path, 5, {"a.bin": b"old"})
    final = save_fake(tmp_path, 5, {"a.bin": b"new!"})
    assert (final / "a.bin").read_bytes() == b"new!" and store.verify(final).ok
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005"]


def test_prune_keeps_the_newest_of_this_run_and_drops_abandoned_futures(tmp_path):
    for step in (10, 20, 30):
        save_fake(tmp_path, step)
    save_fake(tmp_path, 90, lineage="run-a")  # a future this run will not reach (resumed before it)
    save_fake(tmp_path, 5, lineage="old-run")  # another run in the same output_dir
    store.begin(tmp_path, 40)  # a killed save
    ours = lambda path: session.read_state(path)["lineage"] == "run-a"  # noqa: E731
    removed = store.prune(tmp_path, keep_last=2, current_step=30, belongs=ours)
    assert sorted(p.name for p in removed) == ["step-00000005", "step-00000010", "step-00000090"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]


def test_truncate_cuts_a_log_back(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n')
    store.truncate(log, len('{"step": 1}\n'))
    assert log.read_text() == '{"step": 1}\n'
    store.truncate(tmp_path / "missing.jsonl", 0)


# ---------------------------------------------------------------- config comparison

def dump(**sections) -> RunConfig:
    """A config as a checkpoint's is compared: read back into a RunConfig (config/stored.py)."""
    return read_stored({"config": RunConfig.model_validate(sections).model_dump(mode="json")}, "trainer_state.json")


def test_harmless_changes_are_listed_and_math_changes_named():
    old = dump()
    new = dump(logging={"level": "quiet"}, training={"eval_every_steps": 7, "log_every_steps": 1},
               data={"num_workers": 2}, checkpoint={"every_steps": 3}, optim={"lr": 5e-4},
               model={"architecture": {"n_layer": 2}})
    result = fp.compare(old, new)
    assert {c.key for c in result.of("harmless")} >= {"logging.level", "training.eval_every_steps",
                                                        "data.num_workers", "checkpoint.every_steps"}
    math = {c.key: c for c in result.of("math")}
    assert set(math) >= {"optim.lr", "model.architecture.n_layer"}
    assert "update" in math["optim.lr"].why
    assert fp.fingerprint(old) == fp.fingerprint(dump(logging={"level": "quiet"}, data={"num_workers": 2}))
    assert fp.fingerprint(old) != fp.fingerprint(dump(optim={"lr": 5e-4}))


def test_the_global_batch_is_judged_not_its_factors():
    old = dump(training={"micro_batch_size": 4, "gradient_accumulation_steps": 2})
    same = fp.compare(old, dump(training={"micro_batch_size": 8, "gradient_accumulation_steps": 1}))
    assert not same.of("math") and same.accumulation is None
    bigger = fp.compare(old, dump(training={"micro_batch_size": 8, "gradient_accumulation_steps": 2}))
    assert [c.key for c in bigger.of("math")] == ["global batch (micro x accumulation x processes)"]


def test_a_different_world_size_keeps_the_global_batch():
    old = dump(training={"micro_batch_size": 4, "gradient_accumulation_steps": 1}, launch={"num_processes": 2})
    result = fp.compare(old, dump(training={"micro_batch_size": 4, "gradient_accumulation_steps": 1}))
    assert result.accumulation == 2 and "keeping the global batch of 8" in result.world_note
    assert not result.of("math") and not result.refusal
    odd = fp.compare(old, dump(training={"micro_batch_size": 4}, launch={"num_processes": 3}))
    assert "not a whole number" in odd.refusal
    assert "launch.num_processes=1 (accumulation 2)" in odd.refusal and "launch.num_processes=2" in odd.refusal
    assert "no micro-batch on 3 processes" in odd.refusal
    zero2 = dump(parallel={"strategy": "deepspeed"}, training={"micro_batch_size": 4}, launch={"num_processes": 2})
    resharded = fp.compare(zero2, dump(parallel={"strategy": "deepspeed"}, training={"micro_batch_size": 4}))
    assert not resharded.refusal and resharded.accumulation == 2 and resharded.route.how == "universal"
    moved = fp.compare(dump(), dump(parallel={"strategy": "fsdp"}))
    assert [c.kind for c in moved.changes] == ["harmless"] and moved.route.how == "across"
    assert [c.kind for c in fp.compare(dump(), dump(parallel={"strategy": "deepspeed"})).changes] == ["layout"]


def test_routes_say_how_each_checkpoint_moves_and_why_some_cannot():
    from overdrive.checkpoint import routes

    def route(old, new):
        return fp.compare(dump(**old), dump(**new)).route

    two, one = {"num_processes": 2}, {"num_processes": 1}
    zero = lambda stage, **more: {"strategy": "deepspeed", "deepspeed": {"zero_stage": stage, **more}}  # noqa: E731
    assert route({"launch": two}, {"launch": two}).how == "as saved"
    assert route({"launch": two}, {}).how == "accelerate"
    assert route({"parallel": {"strategy": "fsdp"}, "launch": one}, {"parallel": {"strategy": "fsdp"}, "launch": two}
                 ).how == "dcp"
    offload = route({"parallel": zero(3, offload_optimizer="cpu"), "launch": two}, {"parallel": zero(3)})
    assert offload.how == "universal" and offload.universal
    assert offload.summary() == ("ZeRO-3 (optimizer offload to cpu) on 2 processes -> ZeRO-3 on 1 process "
                                 "(DeepSpeed universal checkpoint)")
    across = route({"parallel": zero(2), "launch": two}, {"parallel": {"strategy": "fsdp"}})
    assert across.how == "across" and across.universal and "universal" in across.reader
    stage = fp.compare(dump(parallel=zero(2)), dump(parallel=zero(3)))
    assert stage.route.how == "refused" and "ZeRO stages" in stage.refusal
    assert "Possible moves: DDP <-> FSDP2" in route({"parallel": {"strategy": "fsdp"}}, {"parallel": zero(2)}).refusal
    assert routes.batch_combinations(16, 8, 4) == ("with micro-batch 8: launch.num_processes=1 (accumulation 2), "
                                                   "launch.num_processes=2 (accumulation 1); on 4 processes: "
                                                   "training.micro_batch_size=1 (accumulation 4), "
                                                   "training.micro_batch_size=2 (accumulation 2), "
                                                   "training.micro_batch_size=4 (accumulation 1)")


def test_an_automatic_micro_batch_is_judged_by_its_global_batch():
    saved = dump(training={"micro_batch_size": 4, "gradient_accumulation_steps": 4}, launch={"num_processes": 2})
    auto = dump(training={"micro_batch_size": "auto", "global_batch_size": 32}, launch={"num_processes": 4})
    result = fp.compare(saved, auto)
    assert not result.of("math") and not result.refusal and result.accumulation is None
    other = dump(training={"micro_batch_size": "auto", "global_batch_size": 64})
    assert [c.key for c in fp.compare(saved, other).of("math")] == ["training.global_batch_size"]


def write_checkpoint_with_config(tmp_path, cfg: RunConfig, step=10):
    root = store.checkpoints_dir(cfg.output_dir)
    tmp = store.begin(root, step)
    (tmp / session.TRAINER_STATE).write_text(json.dumps({"lineage": "x", "config": cfg.model_dump(mode="json")}))
    store.commit(tmp, step)


def test_plan_resume_refuses_math_changes_without_force(tmp_path):
    out = str(tmp_path / "run")
    base = {"output_dir": out, "training": {"max_steps": 300}}
    write_checkpoint_with_config(tmp_path, RunConfig.model_validate(base))
    harmless = session.plan_resume(RunConfig.model_validate({**base, "logging": {"level": "quiet"}}))
    assert harmless.checkpoint.name == "step-00000010"
    assert any("logging.level" in note for note in harmless.notes)
    changed = RunConfig.model_validate({"output_dir": out, "training": {"seed": 1, "max_steps": 500}})
    with pytest.raises(UserError) as error:
        session.plan_resume(changed)
    text = error.value.render()
    assert "training.seed: 42 -> 1" in text and "training.max_steps: 300 -> 500" in text
    assert "--force" in text and "data order" in text
    forced = session.plan_resume(changed, force=True)
    assert forced.checkpoint is not None and any("--force" in note for note in forced.notes)
    with pytest.raises(UserError, match="DeepSpeed reads only its own checkpoints"):
        session.plan_resume(RunConfig.model_validate({**base, "parallel": {"strategy": "deepspeed"}}), force=True)
    moved = session.plan_resume(RunConfig.model_validate({**base, "parallel": {"strategy": "fsdp"}}))
    assert moved.route.how == "across" and any("DDP on 1 process -> FSDP2 on 1 process" in n for n in moved.notes)
    never = RunConfig.model_validate({**base, "checkpoint": {"resume": "never"}, "training": {"seed": 1}})
    assert session.plan_resume(never).checkpoint is None


def test_a_finished_run_with_another_config_is_refused_not_replaced(tmp_path):
    """A finished run is a record: another config in its output_dir would replace its metrics
    and checkpoints. Refused without --force, naming each changed key; explain says the same."""
    from overdrive.checkpoint.resume import describe_resume

    out = str(tmp_path / "run")
    write_checkpoint_with_config(tmp_path, RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 10}}))
    other = RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 10}, "parallel": {"strategy": "fsdp"},
                                      "optim": {"lr": 1e-3}})
    with pytest.raises(UserError) as error:
        session.plan_resume(other)
    text = error.value.render()
    assert "parallel.strategy" in text and "optim.lr" in text and "--force" in text and "new output_dir" in text
    said = describe_resume(other)
    assert said["train"] == "refused" and "optim.lr" in said["text"] and "--force" in said["text"]
    # What the finished run's message offers ("raise training.max_steps to train further") is taken as asked.
    longer = RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 20}})
    plan = session.plan_resume(longer)
    assert plan.checkpoint is not None and any("continuing the finished run" in n for n in plan.notes)
    assert describe_resume(longer)["train"] == "resumes"
    longer_and_other = RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 20}, "optim": {"lr": 1e-3}})
    with pytest.raises(UserError, match="training.max_steps"):
        session.plan_resume(longer_and_other)
    same = RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 10}, "logging": {"level": "quiet"}})
    assert session.plan_resume(same).checkpoint is not None
    assert describe_resume(same)["train"] == "resumes"


def test_another_model_in_a_runs_directory_is_refused_with_a_new_directory_never_force(tmp_path):
    """--force cannot load one model's checkpoint into another: it is never offered, and with it
    the refusal is the same short message, not a load error listing every parameter name."""
    out = str(tmp_path / "run")
    write_checkpoint_with_config(tmp_path, RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 10}}))
    other = RunConfig.model_validate({"output_dir": out, "training": {"max_steps": 10},
                                      "model": {"architecture": {"n_layer": 2}}})
    for force in (False, True):
        with pytest.raises(UserError) as error:
            session.plan_resume(other, force=force)
        text = error.value.render()
        assert "model.architecture.n_layer" in text and "--force" not in text
        assert f"output_dir={out}-2" in text


def test_plan_resume_adjusts_accumulation_for_a_new_world_size(tmp_path):
    out = str(tmp_path / "run")
    write_checkpoint_with_config(tmp_path, RunConfig.model_validate(
        {"output_dir": out, "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
         "launch": {"num_processes": 2}}))
    plan = session.plan_resume(RunConfig.model_validate({"output_dir": out, "training": {"micro_batch_size": 4}}))
    assert plan.config.training.gradient_accumulation_steps == 2
    from overdrive.resolving import resolve

    resolved = resolve(cli=[f"output_dir={out}", "training.micro_batch_size=4"], env={})
    adjusted = session.with_plan(resolved, session.plan_resume(resolved.config))
    assert adjusted.config.training.gradient_accumulation_steps == 2
    assert adjusted.origins["training.gradient_accumulation_steps"].layer == "resume"


# ---------------------------------------------------------------- non-finite guard

def fused_setup(fused=True):
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, fused=fused, foreach=False if not fused else None)
    return param, opt


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_step_leaves_weights_and_moments_untouched(fused):
    param, opt = fused_setup(fused)
    guard = nonfinite.NonfiniteGuard("skip", opt, torch.device("cpu"))
    assert guard.device_side is fused
    param.grad = torch.full((3,), float("nan"))
    guard.check(torch.tensor(float("nan")))
    if guard.allows_step():
        opt.step()
    assert torch.equal(param.detach(), torch.ones(3)) and not opt.state.get(param, {}).get("exp_avg", torch.zeros(3)).any()
    param.grad = torch.ones(3)
    guard.check(torch.tensor(1.0))
    if guard.allows_step():
        opt.step()
    assert param.detach()[0] < 1.0 and int(opt.state[param]["step"]) == 1
    assert guard.read() == nonfinite.Counts(1, 1, 0, 0)


def test_the_guard_counts_runs_and_decides_at_logging_steps():
    _, opt = fused_setup()
    guard = nonfinite.NonfiniteGuard("skip", opt, torch.device("cpu"))
    for value in (1.0, float("inf"), float("nan"), float("nan"), 2.0):
        guard.check(torch.tensor(value))
    guard.scaler_skipped()
    counts = guard.read()
    assert counts == nonfinite.Counts(skipped=3, worst_run=3, in_a_row=0, scaler_skips=1)
    assert counts.record() == {"nonfinite_skipped": 3, "loss_scale_skips": 1}
    assert "fp16 loss scaler" in counts.note(5)
    assert counts.verdict("skip", 5, 2.0, 5) == ""
    assert "3 steps in a row" in counts.verdict("skip", 3, 2.0, 5)
    assert guard.read() == nonfinite.Counts()
    assert "not applied" in nonfinite.verdict("stop", 5, 2.0, 1, 1, 5)
    assert nonfinite.verdict("ignore", 1, float("nan"), 9, 9, 5) == ""
    ignore = nonfinite.NonfiniteGuard("ignore", opt, torch.device("cpu"))
    ignore.check(torch.tensor(float("nan")))
    assert ignore.allows_step() and ignore.read() == nonfinite.Counts()


# ---------------------------------------------------------------- signals

def test_sigterm_is_recorded_and_the_old_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_stops_at_once():
    with StopRequest(same_press_s=0) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


# ---------------------------------------------------------------- the agent's failure summary

def test_the_failure_summary_names_the_rank_that_died_first():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from overdrive.launch.elastic import describe

    # The agent stops the survivors with SIGTERM, often within the same second.
    error = ChildFailedError("overdrive.cli", {0: ProcessFailure(0, 100, -signal.SIGTERM, "<N/A>"),
                                               1: ProcessFailure(1, 101, -signal.SIGKILL, "<N/A>")})
    text = describe(error)
    assert text.startswith("overdrive: rank 1 (local rank 1, pid 101") and "was killed by SIGKILL" in text
    assert "also ended: rank 0 (SIGTERM)" in text
    crashed = describe(ChildFailedError("overdrive.cli", {3: ProcessFailure(1, 7, 1, "<N/A>")}))
    assert "rank 3" in crashed and "exited with code 1" in crashed


def test_a_rank_that_left_while_the_others_were_in_a_collective_is_named():
    """Rank 1 ended its run (exit 0) while rank 0 still waited at a barrier, which broke: the
    failure record holds rank 0 alone; the rank that left first is named with why."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from overdrive.launch.elastic import describe

    error = ChildFailedError("overdrive.cli", {4: ProcessFailure(0, 100, 1, "<N/A>")})  # machine 2 of 2 x 4
    text = describe(error, local_world=4)
    assert "rank 4" in text.splitlines()[0]
    assert "left before it: rank 5, rank 6, rank 7 (exit 0: ended its run" in text


# ---------------------------------------------------------------- the data order

def test_each_epoch_order_depends_only_on_the_seed_and_the_epoch():
    from overdrive.data import EpochShuffle

    sampler = EpochShuffle(100, 96, seed=3)
    orders = []
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    fresh = EpochShuffle(100, 96, seed=3)
    fresh.set_epoch(2)  # a resumed run enters epoch 2 directly
    assert list(fresh) == orders[2] and orders[0] != orders[1]
    assert len(orders[0]) == 96 == len(set(orders[0]))
    unshuffled = EpochShuffle(100, 96, seed=3, shuffle=False)
    assert list(unshuffled) == list(range(96))


@pytest.mark.parametrize("micro", [2, 4])
def test_optimizer_step_k_takes_the_same_samples_at_any_world_size(micro):
    """The loader as Accelerate shards it (BatchSamplerShard: micro-batch i to rank i mod world),
    then skipped into the epoch as a resume does: step k's samples, over all ranks and
    accumulation steps, are the same set at 1, 2 and 4 processes."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler

    from overdrive.data.loaders import train_loader

    dataset, global_batch = list(range(100)), 16

    def steps(world: int, skip_steps: int = 0) -> list[set[int]]:
        accumulation = global_batch // (micro * world)
        loader = train_loader(dataset, micro, accumulation, world, seed=5)
        loader.sampler.set_epoch(1)
        per_rank = []
        for rank in range(world):
            shard = BatchSamplerShard(loader.batch_sampler, num_processes=world, process_index=rank)
            batches = list(SkipBatchSampler(shard, skip_batches=skip_steps * accumulation))
            per_rank.append([batches[i:i + accumulation] for i in range(0, len(batches), accumulation)])
        return [{i for rank in per_rank for batch in rank[k] for i in batch} for k in range(len(per_rank[0]))]

    at_one = steps(1)
    assert len(at_one) == 6 and all(len(s) == global_batch for s in at_one)
    assert steps(2) == at_one == steps(4)
    assert steps(2, skip_steps=2) == at_one[2:] == steps(1, skip_steps=2)  # a resume at step 2 on a new world size
