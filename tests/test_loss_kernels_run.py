"""A run with `training.loss_kernel=chunked`, activation offloading and gradient checkpointing logs
the losses of the model's own loss; `data.document_mask` trains on packed text kept apart."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from checkpoint_probe import run
from hf_fixtures import LETTERS, make_tiny_llama
from strategy_probe import free_port, losses_of

pytestmark = pytest.mark.slow  # every test here trains

STEPS = 4
RUN = ["data.max_length=64", "data.validation_fraction=0", "training.log_every_steps=1",
       "training.eval_every_steps=null", "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0",
       "precision.mixed_precision=no", "launch.use_cpu=true", "logging.trackers=[none]",
       "logging.progress=false", "logging.level=quiet", "checkpoint.enabled=false", "checkpoint.save_final_model=false",
       f"training.max_steps={STEPS}", "data.shuffle=false"]
ONE = ["launch.num_processes=1", "training.micro_batch_size=4"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loss-kernel")
    make_tiny_llama(root / "base")
    rng = random.Random(0)
    with open(root / "text.jsonl", "w") as f:  # short documents: several per 64-token block
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 30)))}) + "\n")
    return root


def train(work: Path, out: str, *extra: str) -> list[float]:
    argv = [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'base'}",
            f"data.source={work / 'text.jsonl'}", f"data.cache_dir={work / 'cache'}", *RUN,
            f"launch.main_process_port={free_port()}", f"output_dir={work / out}", *extra]
    done = run(argv, cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses_of(work / out)


@pytest.fixture(scope="module")
def full(work: Path) -> list[float]:
    """The model's own loss at one process: the losses every kernel and strategy here must log."""
    return train(work, "full", *ONE, "training.loss_kernel=full")


def _assert_same(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def test_chunked_offloaded_checkpointed_run_logs_the_full_losses_and_document_mask_trains(work, full):
    chunked = train(work, "chunked", *ONE, "training.loss_kernel=chunked", "training.activation_offloading=true",
                    "model.gradient_checkpointing=true")
    masked = train(work, "masked", *ONE, "training.loss_kernel=chunked", "data.document_mask=true")
    print(f"\nfull {full}\nchunked {chunked}\nmasked {masked}")
    _assert_same(chunked, full)
    assert len(masked) == STEPS
    # Kept apart, a document's first tokens lose the earlier documents' context: other numbers.
    assert all(m == m for m in masked) and masked != full


def test_chunked_under_ddp_at_two_processes_logs_the_one_process_losses(work, full):
    """The kernel runs inside the head's call, inside DDP's forward: the head's gradient is all-reduced."""
    ddp = train(work, "chunked-ddp", "launch.num_processes=2", "training.micro_batch_size=2",
                "training.loss_kernel=chunked")
    _assert_same(ddp, full)


SHARDED = {"fsdp2": ["parallel.strategy=fsdp"],
           "zero3": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"]}


def test_kernels_under_fsdp2_and_zero3_at_two_processes_log_the_one_process_losses(work, full):
    """A head sharded at rest is gathered for its own call by the strategy's hooks (FSDP2's unshard,
    ZeRO-3's module pre-forward and pre-backward gathers), and the kernel runs in that call."""
    logged = {f"{strategy} {kernel}": train(work, f"{kernel}-{strategy}", "launch.num_processes=2",
                                            "training.micro_batch_size=2", f"training.loss_kernel={kernel}", *items)
              for strategy, items in SHARDED.items() for kernel in ("chunked", "fused")}
    print(f"\nfull {full}\n" + "\n".join(f"{name} {losses}" for name, losses in logged.items()))
    for losses in logged.values():
        _assert_same(losses, full)


# One interpreter imports what a row needs once, then measures each row in a process forked from
# it: the row's memory is its own process's, and the libraries are already under its floor (the
# bench's child measures its floor after them), without five more interpreters' imports.
ROWS_IN_FORKS = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import bench_loss_kernel as bench
import peft, transformers  # noqa: F401
from overdrive.training.step import activation_offload, loss_kernels, step_loss  # noqa: F401
for row in json.loads(sys.argv[2]):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            print(json.dumps({**row, **bench.child(row["kernel"], False, False, sys.argv[3], lora=row["lora"],
                                                   loss_path=False, **row["sizes"])}), flush=True)
            code = 0
        finally:
            os._exit(code)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(f"the {row['kernel']} row (lora {row['lora']}) failed")
"""


def test_estimate_is_within_ten_percent_of_the_measured_step_peak_for_every_kernel_with_and_without_lora(tmp_path):
    """`overdrive estimate` against one AdamW step's measured peak for every loss kernel, full
    training and LoRA: bench/bench_loss_kernel.py's rows (a 2-layer Llama at Llama 3's 128,256-token
    vocabulary, fp32 on CPU, the resident set's high-water mark in a process of its own per row)
    at hidden 64 and 1,024 tokens, where the loss's tensors outweigh the weights and their optimizer
    state and fused's CPU kernel takes seconds. An estimate under the peak is the one that runs a
    user out of memory."""
    import importlib.util
    import os
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("bench_loss_kernel", repo / "bench" / "bench_loss_kernel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = {"hidden": 64, "tokens": 1024}
    rows = [{"kernel": kernel, "lora": peft == "lora", "sizes": sizes}
            for peft in ("none", "lora") for kernel in ("full", "chunked", "fused")]
    # glibc gives every allocation over 64 KiB back when freed: the resident set follows the live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(repo / "src")}
    done = subprocess.run([sys.executable, "-c", ROWS_IN_FORKS, str(repo / "bench"), json.dumps(rows),
                           str(tmp_path / "grads.pt")], capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(measured) == len(rows)
    ratios = {f"{row['kernel']}, peft {'lora' if row['lora'] else 'none'}":
              bench.estimate_total(row["kernel"], False, False, peft="lora" if row["lora"] else "none", **sizes)
              / row["step_peak"] for row in measured}
    print("\nestimate / measured peak: " + ", ".join(f"{row} {ratio:.3f}" for row, ratio in ratios.items()))
    assert all(0.90 <= ratio <= 1.10 for ratio in ratios.values()), ratios
