"""Three jobs built to be data-, communication- and compute-bound: `overdrive profile --try` on each.

    python bench/bench_verdicts.py            # writes bench/results/verdicts.md

Each job is `overdrive profile --json --try` as a user types it; the table gives the verdict
against the one the job was built for, the shares of the step, the first advice, and the
before / after that `--try` measured (tokens/s from the profiled steps, both sides under the
profiler, so the ratio is fair).

- data-bound: the default job whose token cache sits on slow storage, simulated by a
  `sitecustomize` that makes every sample read wait `--read-delay` seconds (as a network
  file system with a cold cache would); `data.num_workers=0`.
- communication-bound: two processes under ZeRO-3 with a wide model and a tiny batch
  (micro-batch 1, 32 tokens): many parameters to gather, little to compute.
- compute-bound: the embedded default job, one process, fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "verdicts.md"

SLOW_READS = '''\
"""Simulated slow storage for the data-bound job: every sample read waits."""
import os
import time

from overdrive.data import samples

_read = samples.PackedBlocks.__getitem__
_delay = float(os.environ["BENCH_READ_DELAY_S"])


def _slow_read(self, i):
    time.sleep(_delay)
    return _read(self, i)


samples.PackedBlocks.__getitem__ = _slow_read
'''

COMMON = ["training.eval_every_steps=null", "data.validation_fraction=0", "data.max_bytes=2000000"]


def jobs(work: Path, read_delay: float) -> list[dict]:
    hook = work / "slow-reads"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_READS)
    return [
        {"name": "data-bound", "expected": "data",
         "items": [*COMMON, "data.num_workers=0", f"output_dir={work / 'data'}"],
         "env": {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
                 "BENCH_READ_DELAY_S": str(read_delay)},
         "built": f"default job, every sample read waits {read_delay * 1000:.0f} ms (slow storage), num_workers 0"},
        {"name": "communication-bound", "expected": "communication",
         "items": [*COMMON, "launch.num_processes=2", "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                   "model.architecture.n_embd=512", "model.architecture.n_layer=4", "model.architecture.n_head=8",
                   "training.micro_batch_size=1", "data.max_length=32", f"output_dir={work / 'communication'}"],
         "env": {}, "built": "2 processes, ZeRO-3, 4 layers x 512 wide, micro-batch 1 of 32 tokens"},
        {"name": "compute-bound", "expected": "compute", "items": [*COMMON, f"output_dir={work / 'compute'}"],
         "env": {}, "built": "the embedded default job, one process, fp32"},
    ]


def profile(job: dict, steps: int, warmup: int) -> tuple[dict, float]:
    command = [sys.executable, "-m", "overdrive.cli", "profile", *job["items"], "--steps", str(steps),
               "--warmup", str(warmup), "--json", "--try"]
    started = time.monotonic()
    done = subprocess.run(command, env={**os.environ, **job["env"]}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{job['name']}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout), time.monotonic() - started


def row(job: dict, report: dict, seconds: float) -> str:
    shares = report["shares"]
    tried = report.get("try") or {}
    advice = report["advice"][0] if report["advice"] else None
    first = f"`{advice['key']}={json.dumps(advice['value'])}`" if advice else "none"
    before, after = tried.get("before", {}), tried.get("after", {})
    verdict = report["bottleneck"]
    return (f"| {job['name']} | {job['built']} | {verdict} ({'right' if verdict == job['expected'] else 'WRONG'}) | "
            + " / ".join(f"{shares[p]:.0%}" for p in ("data", "forward", "backward", "optimizer", "communication",
                                                       "other"))
            + f" | {first} | {before.get('tokens_per_s', 0):,.0f} | {after.get('tokens_per_s', 0):,.0f} | "
            f"{tried.get('speedup', 0):.2f}x | {after.get('bottleneck', '-')} | {seconds:.0f} s |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--read-delay", type=float, default=0.05, help="seconds per sample read (data-bound job)")
    parser.add_argument("--only", nargs="*", help="job names to run (default all)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-verdicts-"))
    rows, wrong = [], 0
    for job in jobs(work, args.read_delay):
        if args.only and job["name"] not in args.only:
            continue
        report, seconds = profile(job, args.steps, args.warmup)
        rows.append(row(job, report, seconds))
        wrong += report["bottleneck"] != job["expected"]
        print(rows[-1], flush=True)
    lines = ["# Verdicts of `overdrive profile` on jobs built for each bottleneck, and `--try` of the first advice",
             "", f"{args.warmup} warm-up and {args.steps} measured optimizer steps per profile; tokens/s from the "
             "profiled steps (both sides under the profiler).", "",
             "| job | built as | verdict | data / forward / backward / optimizer / communication / other | "
             "first advice | before (tokens/s) | after --try | speedup | verdict after | wall time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             f"Written by `python bench/bench_verdicts.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d %H:%M')}.",
             ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
