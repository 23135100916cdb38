"""What resuming on another world size costs, on the largest model this machine trains in minutes.

A GPT-2 shape of ~114M parameters (16 layers of width 768; a small vocabulary keeps the
tokenizer cheap) trains one step on 2 processes and checkpoints; the same command on 1
process then resumes from it, as a preempted job would. Read from the resume's own messages:
DeepSpeed's universal conversion (seconds, and its size on disk against the checkpoint it
came from) and the whole resharded load; FSDP2's DCP checkpoint needs no conversion and is
measured the same way for comparison.

Target: the universal form takes at most 1.5x the checkpoint's disk (it adds the fp32
weights once more, beside the weights and Adam moments already in the checkpoint).
Run: python bench/bench_reshard.py [--layers 16] [--width 768]
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "reshard.md"
STRATEGIES = {"ZeRO-2": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"],
              "ZeRO-3": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"],
              "FSDP2": ["parallel.strategy=fsdp"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(out: Path, cache: Path, world: int, layers: int, width: int, extra: list[str]) -> str:
    command = [sys.executable, "-m", "overdrive.cli", "train", f"model.architecture.n_layer={layers}",
               f"model.architecture.n_embd={width}", f"model.architecture.n_head={width // 64}",
               "model.architecture.n_positions=64", "tokenizer.vocab_size=512", "data.max_bytes=60000",
               "data.max_length=32", "training.micro_batch_size=1", "training.max_steps=2", "scheduler.warmup_steps=1",
               "checkpoint.every_steps=1", "checkpoint.keep_last=5", "checkpoint.save_final_model=false",
               "training.eval_batches=1", "logging.trackers=[none]", "logging.progress=false",
               f"launch.num_processes={world}", "training.gradient_accumulation_steps=1",
               f"launch.main_process_port={free_port()}",
               f"data.cache_dir={cache}", f"output_dir={out}", *extra]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)}\nfailed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def measure(name: str, work: Path, cache: Path, layers: int, width: int) -> dict:
    out = work / name
    started = time.perf_counter()
    train(out, cache, 2, layers, width, STRATEGIES[name])
    first = out / "checkpoints" / "step-00000001"
    checkpoint_mb = size_mb(first)
    shutil.rmtree(out / "checkpoints" / "step-00000002")  # resume from step 1, on one process
    stdout = train(out, cache, 1, layers, width, STRATEGIES[name])
    converted = re.search(r"universal checkpoint in ([\d.]+) s \(([\d.]+) MB beside the checkpoint's ([\d.]+) MB", stdout)
    loaded = re.search(r"resharded .* in ([\d.]+) s", stdout)
    if loaded is None:
        raise SystemExit(f"{name}: no resharding message in\n{stdout[-2000:]}")
    return {"strategy": name, "checkpoint_mb": checkpoint_mb,
            "conversion_s": float(converted.group(1)) if converted else None,
            "universal_mb": float(converted.group(2)) if converted else None,
            "load_s": float(loaded.group(1)), "wall_s": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    args = parser.parse_args()
    params = args.layers * 12 * args.width ** 2 + (512 + 64) * args.width
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as tmp:
        work = Path(tmp)
        for name in args.strategies:
            rows.append(measure(name, work, work / "cache", args.layers, args.width))
            print(rows[-1], flush=True)
    lines = [f"## Resharding cost: 2 -> 1 processes, GPT-2 shape {args.layers} x {args.width} "
             f"(~{params / 1e6:.0f}M parameters)", "",
             "| strategy | checkpoint on disk | universal conversion | universal form on disk | resharded load "
             "(conversion included) |", "|---|---|---|---|---|"]
    met = True
    for r in rows:
        conversion = f"{r['conversion_s']:.1f} s" if r["conversion_s"] is not None else "none (DCP reshards on load)"
        universal = (f"{r['universal_mb']:.0f} MB ({r['universal_mb'] / r['checkpoint_mb']:.2f}x)"
                     if r["universal_mb"] is not None else "-")
        if r["universal_mb"] is not None and r["universal_mb"] > 1.5 * r["checkpoint_mb"]:
            met = False
        lines.append(f"| {r['strategy']} | {r['checkpoint_mb']:.0f} MB | {conversion} | {universal} | {r['load_s']:.1f} s |")
    lines += ["", "Measured on this machine's CPU processes over gloo (2 cores, shared); the conversion is "
              "DeepSpeed's ds_to_universal in one process, run once per checkpoint and cached beside it."]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
