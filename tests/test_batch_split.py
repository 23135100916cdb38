"""The batch split, settled once: `training.global_batch_size` derives the accumulation or is
refused by key, and train, tune, plan, the DeepSpeed dict and a resumed run read the same split."""

from __future__ import annotations

import json

import pytest

from overdrive.config import batch
from overdrive.config.stored import read_stored
from overdrive.resolving import resolve
from overdrive.errors import UserError

TINY = ["model.architecture.model_type=gpt2", "model.architecture.n_layer=1", "model.architecture.n_head=2",
        "model.architecture.n_embd=32", "model.architecture.n_positions=64", "tokenizer.vocab_size=512",
        "data.max_length=32", "data.max_bytes=60000"]


def resolved(tmp_path, *items):
    return resolve(cli=[*TINY, f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *items],
                   env={}, accelerate_default=False)


def test_the_global_batch_derives_the_accumulation_and_says_so(tmp_path):
    run = resolved(tmp_path, "training.global_batch_size=64")
    assert batch.split(run.config) == batch.BatchSplit(8, 8, 1, 64)
    origin = run.origins["training.gradient_accumulation_steps"]
    assert origin.layer == "derived" and "training.global_batch_size=64" in str(origin)
    # Over 4 processes the same global batch takes fewer micro-batches per process.
    assert batch.split(resolved(tmp_path, "training.global_batch_size=64", "launch.num_processes=4").config
                       ).accumulation == 2
    # An accumulation that agrees is the user's own; without a global batch nothing is derived.
    agreed = resolved(tmp_path, "training.global_batch_size=64", "training.gradient_accumulation_steps=8")
    assert agreed.origins["training.gradient_accumulation_steps"].layer == "cli"
    assert batch.split(resolved(tmp_path).config) == batch.BatchSplit(8, 1, 1, 8)


def test_a_global_batch_that_does_not_divide_or_contradicts_is_refused_by_key(tmp_path):
    with pytest.raises(UserError) as error:
        resolved(tmp_path, "training.global_batch_size=999")
    text = error.value.render()
    assert "training.global_batch_size: 999 is not a multiple of micro-batch 8" in text
    assert "992 (accumulation 124) or 1000 (accumulation 125)" in text  # the values that do divide
    assert "keep 999 with training.micro_batch_size=999 (accumulation 1), 333 (accumulation 3)" in text
    with pytest.raises(UserError) as error:
        resolved(tmp_path, "training.global_batch_size=64", "training.gradient_accumulation_steps=2")
    text = error.value.render()
    assert "training.gradient_accumulation_steps: is 2" in text and "training.global_batch_size=64" in text
    with pytest.raises(UserError, match="does not divide over 3 data-parallel processes"):
        resolved(tmp_path, "training.micro_batch_size=auto", "training.global_batch_size=16", "launch.num_processes=3")


def test_the_same_config_gives_the_same_split_in_train_tune_plan_and_a_resumed_run(tmp_path):
    from overdrive.checkpoint import fingerprint, session, store
    from overdrive.strategies.deepspeed_config import ds_config
    from overdrive.memory.plan import DataSize, arithmetic
    from overdrive.training.build import settle
    from overdrive.tune.space import Facts, build_space

    run = resolved(tmp_path, "training.global_batch_size=32", "training.micro_batch_size=4")
    expected = batch.BatchSplit(4, 8, 1, 32)
    # train: settle() is what train() runs before building anything (a bare RunConfig too).
    trained = settle.settle(run, False, build=lambda cfg: None).config
    bare = run.config.model_copy(update={"training": run.config.training.model_copy(
        update={"gradient_accumulation_steps": 1})})  # as a Python caller builds it: nothing derived yet
    assert batch.split(trained) == batch.split(settle.settle(bare, False, build=lambda cfg: None).config) == expected
    # tune: every candidate keeps the global batch, the baseline is the settled split.
    space = build_space(bare, Facts(cpu_cores=2, gpu=False, supports_bf16=True, compiler="g++"))
    baseline = dict(space.baseline.option("batch").values)
    assert space.global_batch == 32 and baseline == {"training.micro_batch_size": 4,
                                                      "training.gradient_accumulation_steps": 8}
    # plan
    math = arithmetic(run.config, DataSize(None, "unknown"), 4)
    assert (math.micro_batch, math.accumulation, math.world, math.global_batch) == (4, 8, 1, 32)
    # DeepSpeed's dict
    ds = ds_config(run.config.model_copy(update={"parallel": run.config.parallel.model_copy(
        update={"strategy": "deepspeed"})}), 1, find_hidden_size=False)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 8, 32)
    # a resumed run: the checkpoint's global batch is the split's, and the plan resumes it unchanged
    root = store.checkpoints_dir(run.config.output_dir)
    tmp = store.begin(root, 3)
    (tmp / session.TRAINER_STATE).write_text(json.dumps({"lineage": "x", "config": run.config.model_dump(mode="json")}))
    store.commit(tmp, 3)
    again = resolved(tmp_path, "training.global_batch_size=32", "training.micro_batch_size=4")
    plan = settle.resume_plan(again)
    assert plan.checkpoint is not None and batch.split(plan.config) == expected
    stored = json.loads(json.dumps({"config": run.config.model_dump(mode="json")}))
    assert fingerprint.global_batch(read_stored(stored, "trainer_state.json")) == 32
    # ... and on two processes the derived accumulation keeps that global batch, with nothing to adjust
    two = resolved(tmp_path, "training.global_batch_size=32", "training.micro_batch_size=4", "launch.num_processes=2")
    moved = settle.resume_plan(two)
    assert batch.split(moved.config) == batch.BatchSplit(4, 4, 2, 32) and moved.checkpoint is not None


def test_explain_key_shows_the_accumulation_the_run_uses_and_where_it_came_from():
    from conftest import run_here

    done = run_here("explain", "training.global_batch_size=64", "training.micro_batch_size=8",
                   "--key", "training.gradient_accumulation_steps")
    assert done.returncode == 0, done.stderr
    first, *rows = done.stdout.strip().splitlines()
    assert first == "training.gradient_accumulation_steps = 8"
    assert "derived" in rows[-1] and "training.global_batch_size=64" in rows[-1] and "[wins]" in rows[-1]
