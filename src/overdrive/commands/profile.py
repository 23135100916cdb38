"""`overdrive profile [FILES...] [key=value ...] [--steps N] [--json] [--try]`

Runs the configured job (any strategy, any process count) for warm-up plus measured steps
under torch.profiler and reports, per rank and per optimizer step, the seconds in data,
forward, backward, optimizer, communication and other; peak memory, the top operators,
MFU; the bottleneck and the keys to change. Traces (Chrome trace JSON and TensorBoard's
profiler format) go to `<output_dir>/profile/`; the profiled run itself (no checkpoints)
to `<output_dir>/profile/run`, so the job's own run directory is left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="FILE | KEY=VALUE",
                        help="config files (applied in order) and dotted overrides, as for `overdrive train`")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps measured (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps run first and not measured (default 3)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (a stable contract)")
    parser.add_argument("--try", dest="try_advice", action="store_true",
                        help="profile again with the first advice applied, and print before and after")
    parser.add_argument("--resolved", metavar="PATH", help=argparse.SUPPRESS)  # a worker of the profiled job
    parser.add_argument("--profile-dir", metavar="PATH", help=argparse.SUPPRESS)
    from overdrive.commands.arguments import add_accelerate_default_argument

    add_accelerate_default_argument(parser)


def run(args: argparse.Namespace) -> int:
    from overdrive.errors import Problem, UserError

    if args.steps < 1 or args.warmup < 0:
        raise UserError(Problem("--steps", "needs --steps >= 1 and --warmup >= 0"))
    if args.resolved:
        return _worker(args)
    from overdrive.observe.profile_report import render

    files = [item for item in args.items if "=" not in item]
    cli = [item for item in args.items if "=" in item]
    # With --json, stdout is the contract alone: what the job prints (libraries included,
    # in this process and in the workers, which inherit the descriptor) goes to stderr.
    with _stdout_to_stderr(args.json):
        report = profile(files, cli, args.steps, args.warmup, accelerate_default=not args.no_accelerate_default)
        if args.try_advice:
            report["try"] = _try(files, cli, args, report)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render(report))
    return 0


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _try(files, cli, args, before) -> dict:
    if not before["advice"]:
        return {"key": None, "note": "no advice to try"}
    top = before["advice"][0]
    change = f"{top['key']}={json.dumps(top['value']) if not isinstance(top['value'], str) else top['value']}"
    after = profile(files, cli + [change], args.steps, args.warmup, subdir="try",
                    accelerate_default=not args.no_accelerate_default)
    pick = lambda r: {"step_s": max(x["step_s"] for x in r["ranks"]), "tokens_per_s": r["tokens_per_s"],  # noqa: E731
                      "bottleneck": r["bottleneck"], "mfu": r.get("mfu")}
    return {"key": top["key"], "value": top["value"], "before": pick(before), "after": pick(after),
            "speedup": after["tokens_per_s"] / max(before["tokens_per_s"], 1e-12)}


def _worker(args) -> int:
    from overdrive.commands.arguments import load_run as _load
    resolved, _ = _load(argparse.Namespace(items=[], resolved=args.resolved))
    _train_profiled(resolved, Path(args.profile_dir), args.warmup, args.steps)
    return 0


def _train_profiled(resolved, profile_dir: Path, warmup: int, steps: int) -> None:
    from overdrive.observe.profiling import ProfilingObserver
    from overdrive.training.loop import train
    from overdrive.training.telemetry import peak_memory_mb

    if not resolved.config.launch.num_processes > 1:
        # Profiled in this process, maybe a second time (--try): Accelerate's state is a
        # process-wide singleton that would keep the first run's settings.
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    train(resolved, observer=lambda out, acc: ProfilingObserver(out, acc, profile_dir, warmup, steps, peak_memory_mb))


# Settings of the profiled run: a short run of its own, from scratch, that saves nothing.
PROFILE_RUN = ["checkpoint.enabled=false", "checkpoint.resume=never", "checkpoint.save_final_model=false",
               "training.eval_every_steps=null", "logging.trackers=[none]", "logging.progress=false",
               "logging.level=quiet"]


def profile(files: list[str], cli: list[str], steps: int, warmup: int, subdir: str = "",
            accelerate_default: bool = True) -> dict:
    """Profile the job `files` + `cli` describe; the report (the --json contract)."""
    from overdrive.resolving import resolve
    from overdrive.launch import workers
    from overdrive.launch.process import hide_gpus_for_cpu_runs, local_processes, threads_per_process
    from overdrive.observe.profile_report import collect, summarise

    base = resolve(files, cli=cli, accelerate_default=accelerate_default).config
    profile_dir = Path(base.output_dir).expanduser() / "profile" / subdir
    total = warmup + steps
    resolved = resolve(files, cli=[*cli, *PROFILE_RUN, f"training.max_steps={total}",
                                   f"training.log_every_steps={total}", f"output_dir={profile_dir / 'run'}"],
                       accelerate_default=accelerate_default)
    cfg = resolved.config
    hide_gpus_for_cpu_runs(cfg)
    for old in [*profile_dir.glob("phases.rank*.json"), *profile_dir.glob("trace.rank*.json"),
                *profile_dir.glob("tensorboard/*.json")]:
        old.unlink()  # this measurement's files only, not a previous one's
    code = workers.run_on_ranks(resolved, "profile", lambda here: _train_profiled(here, profile_dir, warmup, steps),
                                "--steps", str(steps), "--warmup", str(warmup), "--profile-dir", str(profile_dir))
    if code:
        from overdrive.errors import UserError

        raise UserError(f"the profiled job failed (exit {code}); its output above says why")
    from overdrive.training.metrics import path_in, read

    logged = [r for r in read(path_in(cfg.output_dir)).records if r.get("mfu") is not None]
    return summarise(cfg, collect(profile_dir), profile_dir, cores_per_process=threads_per_process(cfg),
                     processes_here=local_processes(cfg), mfu=logged[-1]["mfu"] if logged else None)


