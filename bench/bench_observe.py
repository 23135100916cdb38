"""What the always-on step timers and heartbeats cost: tokens/s with them against without.

One run trains the same job (same config, seed, data) alternately with the run's observer
(step timers, the per-rank heartbeat thread and live record, the gradient hooks) and with
it switched off (`observe.for_run(..., timers=False)`), in ABBA order so drift on a shared
machine falls on both equally. Tokens/s is steady state: from the end of optimizer step
`--warmup` to the end of step `--steps`, as metrics.jsonl records them. The table reports
every pair's ratio and the median; the target is at most 1% lost.

    python bench/bench_observe.py              # writes bench/results/observe.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = 0.99  # with / without, median: at least this


def config(args, out: Path):
    from overdrive.config.schema import RunConfig

    return RunConfig.model_validate({
        "data": {"cache_dir": args.cache_dir, "max_length": args.seq_len, "validation_fraction": 0.0,
                 "max_bytes": 2_000_000},
        "training": {"micro_batch_size": args.micro_batch, "max_steps": args.steps, "log_every_steps": args.warmup,
                     "eval_every_steps": None},
        "checkpoint": {"enabled": False, "save_final_model": False},
        "logging": {"trackers": ["none"], "progress": False, "level": "quiet"},
        "output_dir": str(out),
    })


def tokens_per_s(cfg, timers: bool, args) -> float:
    from accelerate.state import AcceleratorState, GradientState

    from overdrive import observe
    from overdrive.training import metrics
    from overdrive.training.loop import train

    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: each run starts afresh
    GradientState._reset_state()
    train(cfg, observer=lambda out, acc: observe.for_run(out, acc, timers=timers))
    logged = metrics.read(metrics.path_in(cfg.output_dir)).records
    start = next(r for r in logged if r["step"] == args.warmup)
    end = next(r for r in logged if r["step"] == args.steps)
    return (end["tokens"] - start["tokens"]) / (end["time"] - start["time"])


def per_call_costs(work: Path, calls: int = 200_000) -> dict[str, float]:
    """Seconds per call of what the loop pays: a phase change (clock, sums, the live map), a
    step end, a gradient hook, and one heartbeat write (paid by its thread once a second).
    Independent of how busy the machine is, unlike tokens/s."""
    from overdrive.observe.heartbeat import Heartbeat
    from overdrive.observe.steps import StepRecorder

    rec = StepRecorder()
    costs = {}
    with Heartbeat(rec, work / "costs", rank=0, local_rank=0, world_size=1, interval_s=3600) as beat:
        phases = ("data", "forward", "backward", "optimizer")
        start = time.perf_counter()
        for i in range(calls):
            rec.enter(phases[i & 3])
        costs["phase change"] = (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for i in range(calls):
            rec.step_done(i)
        costs["step end"] = (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for _ in range(calls):
            rec._grad_ready(None)
        costs["gradient hook"] = (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for _ in range(200):
            beat.write()
        costs["heartbeat write (1/s, its own thread)"] = (time.perf_counter() - start) / 200
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cache-dir", default="~/.cache/overdrive")
    parser.add_argument("--out", default=str(HERE / "results" / "observe.md"))
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-observe-"))
    costs = per_call_costs(work)
    tokens_per_s(config(args, work / "warm-up"), True, args)  # caches filled, first-run costs paid
    pairs = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        rates = {timers: tokens_per_s(config(args, work / f"{i}-{timers}"), timers, args) for timers in order}
        pairs.append((rates[True], rates[False]))
        print(f"pair {i + 1}: with {rates[True]:,.0f}  without {rates[False]:,.0f}  ratio "
              f"{rates[True] / rates[False]:.4f}", flush=True)
    ratios = [w / wo for w, wo in pairs]
    median = statistics.median(ratios)
    lines = ["# Always-on step timers and heartbeats: tokens/s with / without", "",
             f"Default model, micro-batch {args.micro_batch}, sequence {args.seq_len}, steps {args.warmup}..{args.steps} "
             f"timed, {args.pairs} pairs in ABBA order, one process.", "",
             "| pair | with (tokens/s) | without (tokens/s) | with / without |", "| --- | --- | --- | --- |"]
    lines += [f"| {i + 1} | {w:,.0f} | {wo:,.0f} | {w / wo:.4f} |" for i, (w, wo) in enumerate(pairs)]
    lines += ["", f"Median with / without: **{median:.4f}** (target >= {TARGET}: {'met' if median >= TARGET else 'NOT met'}); "
              f"pairs range {min(ratios):.4f} .. {max(ratios):.4f}.",
              "", "What the loop pays per call (measured in the same run; a step pays 4 phase changes per",
              "micro-batch, 2-3 more per step, one step end, and one gradient hook per parameter):", "",
              "| call | microseconds |", "| --- | --- |"]
    lines += [f"| {name} | {seconds * 1e6:.2f} |" for name, seconds in costs.items()]
    lines += ["", f"Written by `python bench/bench_observe.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d %H:%M')}.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if median >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
