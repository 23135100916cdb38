"""Resume anywhere: a checkpoint written on N processes (or under another strategy) continues on
M with the losses of the uninterrupted run, within 1e-4 relative, to the same last step.

One uninterrupted run per (strategy, world size) is the reference and, through its checkpoint
of step 5, the source: the resumed run is the same command on another world size (or with
another `parallel.strategy`), in a copy of its output_dir without the later checkpoint. The
DDP case is stopped with SIGTERM instead, at whatever step the signal lands. Dropout is off:
each rank draws its own masks, so a world-size change could not give the same ones.
"""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoint_probe import assert_same_losses, command, finish, kill_group, losses, run, start, steps_logged, \
    wait_for, warm_cache
from strategy_probe import free_port

pytestmark = pytest.mark.slow

MAX_STEPS, SAVED_AT, MICRO, GLOBAL_BATCH = 12, 5, 4, 8
RUN = ["model.architecture.resid_pdrop=0", "model.architecture.embd_pdrop=0", "model.architecture.attn_pdrop=0",
       f"training.max_steps={MAX_STEPS}", f"training.micro_batch_size={MICRO}", "data.max_bytes=60000",
       f"checkpoint.every_steps={SAVED_AT}", "checkpoint.keep_last=5", "training.eval_batches=1"]
STRATEGIES = {
    "ddp": ["parallel.strategy=ddp"],
    "zero2": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"],
    "zero3": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"],
    "zero3-offload": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                      "parallel.deepspeed.offload_optimizer=cpu"],
    "fsdp2": ["parallel.strategy=fsdp"],
}
LABELS = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3-offload": "ZeRO-3 (optimizer offload to cpu)",
          "fsdp2": "FSDP2"}


def args(strategy: str, world: int, steps: int = MAX_STEPS) -> list[str]:
    return [*RUN, *STRATEGIES[strategy], f"launch.num_processes={world}",
            f"training.gradient_accumulation_steps={max(1, GLOBAL_BATCH // (MICRO * world))}",
            f"launch.main_process_port={free_port()}", f"training.max_steps={steps}"]


def processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return warm_cache(tmp_path_factory.mktemp("reshard-cache"), RUN)


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache):
    """(strategy, world[, steps]) -> the output_dir of its uninterrupted run, run on first use."""
    done = {}

    def get(strategy: str, world: int, steps: int = MAX_STEPS):
        if (strategy, world, steps) not in done:
            work = tmp_path_factory.mktemp(f"reference-{strategy}-{world}-{steps}")
            proc = run(command(work / "run", cache, *args(strategy, world, steps)), cwd=work, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert steps_logged(work / "run") == list(range(1, steps + 1))
            done[strategy, world, steps] = work / "run"
        return done[strategy, world, steps]
    return get


def resume(source, strategy: str, world: int, cache, tmp_path, stopped_at: int, steps: int = MAX_STEPS):
    """The same command on `world` processes (and `strategy`): accumulation as the user had it,
    so the resume itself must find the one that keeps the global batch."""
    out = tmp_path / "resumed"
    if source != out:
        shutil.copytree(source, out)
    for later in (out / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > stopped_at:
            shutil.rmtree(later)
    source_world = json.loads((out / "checkpoints" / f"step-{stopped_at:08d}" / "trainer_state.json").read_text()
                              )["world_size"]
    given = [a for a in args(strategy, world, steps) if not a.startswith("training.gradient_accumulation_steps")]
    given.append(f"training.gradient_accumulation_steps={GLOBAL_BATCH // (MICRO * source_world)}")
    proc = run(command(out, cache, *given), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, proc.stdout


# One case per behaviour (each engine shrinking and growing, offload, across engines), not per
# combination: each case is two multi-process runs.
CASES = [  # (from strategy, from world, to strategy, to world)
    ("zero3-offload", 1, "zero3-offload", 2), ("fsdp2", 1, "fsdp2", 2), ("ddp", 2, "fsdp2", 2),
    ("zero2", 2, "fsdp2", 1),
]


@pytest.mark.parametrize("source,source_world,target,target_world", CASES,
                         ids=[f"{a}x{n}-to-{b}x{m}" for a, n, b, m in CASES])
def test_a_checkpoint_continues_on_another_world_size_or_strategy(references, cache, tmp_path, source, source_world,
                                                                 target, target_world):
    reference = references(source, source_world)
    out, stdout = resume(reference, target, target_world, cache, tmp_path, SAVED_AT)
    summary = (f"{LABELS[source]} on {processes(source_world)} -> {LABELS[target]} on {processes(target_world)}")
    assert f"resharded {summary}" in stdout
    if source_world != target_world:
        accumulation = GLOBAL_BATCH // (MICRO * target_world)
        assert (f"keeping the global batch of {GLOBAL_BATCH} (micro-batch {MICRO} x accumulation {accumulation} "
                f"x {target_world})") in stdout
    if source.startswith("zero"):
        assert "to DeepSpeed's universal checkpoint in" in stdout
        assert (out / "checkpoints" / f"step-{SAVED_AT:08d}" / "universal" / "conversion.json").exists()
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
    assert_same_losses(losses(reference), losses(out), range(SAVED_AT + 1, MAX_STEPS + 1), rel=1e-4)


def test_ddp_stopped_by_sigterm_on_two_processes_continues_on_one(references, cache, tmp_path):
    """The resume that used to stop with "accumulation out of step with the data"."""
    # A longer run than the others: the signal must land while it is still going, and a tiny
    # DDP step takes milliseconds while the signal passes launcher, agent and worker.
    steps = 40
    reference = references("ddp", 2, steps)
    out = tmp_path / "resumed"
    proc = start(command(out, cache, *args("ddp", 2, steps), "checkpoint.every_steps=1000"), cwd=tmp_path)
    wait_for(lambda: len(steps_logged(out)) >= 3, proc, what="step 3")
    kill_group(proc, sig=15)
    code, _, stderr = finish(proc)
    assert code == 128 + 15, stderr[-3000:]
    stopped = max(steps_logged(out))
    assert stopped < steps
    _, stdout = resume(out, "ddp", 1, cache, tmp_path, stopped, steps)
    assert "resharded DDP on 2 processes -> DDP on 1 process" in stdout
    assert "keeping the global batch of 8 (micro-batch 4 x accumulation 2 x 1)" in stdout
    assert steps_logged(out) == list(range(1, steps + 1))
    assert_same_losses(losses(reference), losses(out), range(stopped + 1, steps + 1), rel=1e-4)


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_with_the_ones_that_can(references, cache,
                                                                                         tmp_path):
    out = tmp_path / "run"
    shutil.copytree(references("ddp", 2), out)
    shutil.rmtree(out / "checkpoints" / f"step-{MAX_STEPS:08d}")
    proc = run(command(out, cache, *args("ddp", 3)), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the global batch of 8 cannot be kept on 3 processes" in proc.stderr
    assert "launch.num_processes=2 (accumulation 1)" in proc.stderr
    into_zero = run(command(out, cache, *args("zero2", 2)), cwd=tmp_path)
    assert into_zero.returncode == 2 and "DeepSpeed reads only its own checkpoints" in into_zero.stderr
