"""`overdrive train [FILES...] [key=value ...] [--resolved run.json]`

Bare, it trains the embedded default: a small GPT-2-style model from scratch on the Python
standard library's own source. With several processes configured it starts the workers,
each of which re-enters this command with `--resolved` and trains.

Run again, the same command continues from the newest complete checkpoint in output_dir
(`checkpoint.resume=auto`); `--force` resumes even when the config changed the math.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import sys

from overdrive.commands.arguments import add_accelerate_default_argument, load_run

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

EXAMPLES = """\
examples:
  overdrive train                                   the embedded default (a small model, runs/default)
  overdrive train run.yaml                          your config file
  overdrive train run.yaml training.max_steps=20 lr=3e-4
                                                    files first, then dotted overrides: KEY=VALUE, no spaces, no --
  overdrive train run.yaml parallel.strategy=fsdp launch.num_processes=2
  OVERDRIVE_TRAINING__MAX_STEPS=20 overdrive train run.yaml
                                                    an environment variable: OVERDRIVE_<SECTION>__<KEY>

Resuming is automatic: run the same command again and it continues from the newest complete
checkpoint in output_dir (checkpoint.resume=auto). --force resumes even when the config changed
keys that alter the math. Every key: `overdrive explain`, docs/config.md.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "items", nargs="*", metavar="FILE | KEY=VALUE",
        help="config files (applied in order) and dotted overrides such as lr=3e-4 or "
        "parallel.strategy=fsdp",
    )
    parser.add_argument(
        "--resolved", metavar="PATH",
        help="train exactly this resolved config (written by the launcher; nothing is re-resolved)",
    )
    parser.add_argument(
        "--force", action="store_true",
        help="resume from the checkpoint in output_dir even though the config changed keys that alter the math "
        "(the message without --force lists them)",
    )
    parser.add_argument(
        "--preflight", action="store_true",
        help="run `overdrive preflight` first (rendezvous, bandwidth, shared output_dir, same versions and config) "
        "and train only if it passes",
    )
    parser.add_argument(
        "--print-launch", action="store_true",
        help="print the equivalent torchrun, `accelerate launch` and srun command lines, and exit",
    )
    add_accelerate_default_argument(parser)


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "resolved", None):  # the launcher says it once; its workers do not
        from overdrive.system.tested import drift, drift_line

        untested = drift_line(drift())  # a warning: newer releases usually work
        if untested:
            print(untested, file=sys.stderr)
    from overdrive.resolving.resolved import config_directories
    from overdrive.training.objectives import rewards
    from overdrive.training.build import user_inputs
    from overdrive.training.build.preconditions import before_launch

    # Every check before launch (the user's code and data, this machine, the model's config, the
    # adapter) is judged with the resolver's rules: one message names every problem. --print-launch
    # prints lines for other machines.
    rules = None if getattr(args, "print_launch", False) else before_launch
    resolved, in_worker = load_run(args, checks=user_inputs.check, rules=rules)
    # The reward modules beside the config files, on every rank: each imports them again.
    with rewards.importable_from(config_directories(resolved.origins.values())):
        return _run_command(args, resolved, in_worker)


def _run_command(args: argparse.Namespace, resolved, in_worker: bool) -> int:
    cfg = resolved.config
    if in_worker:
        from overdrive.launch import lifetime, membership

        lifetime.follow_agent(cfg.launch.stop_timeout)  # no worker outlives its launcher
        resolved = membership.as_launched(resolved)  # an elastic job that lost a machine
        cfg = resolved.config
    if getattr(args, "print_launch", False):
        from overdrive.launch.lines import print_launch

        return print_launch(resolved)
    from overdrive.storage import faults

    # A write fault without a path of its own (a tracker's thread) is told against these.
    with faults.places(**{"output_dir": cfg.output_dir, "data.cache_dir": cfg.data.cache_dir}):
        return _run(args, resolved, in_worker)


def _run(args: argparse.Namespace, resolved, in_worker: bool) -> int:
    cfg = resolved.config
    if not in_worker:
        from overdrive.launch.process import hide_gpus_for_cpu_runs

        hide_gpus_for_cpu_runs(cfg)  # before anything here asks CUDA
        # What this machine lacks (bf16, GPUs, ...), the model's config and the adapter were judged
        # with the config (training/preconditions.before_launch); workers skip it: the launcher checked
        # the same resolved config.
        from overdrive.storage.faults import writable_target

        # Only now, every check passed, is anything written: the output directory and its lock
        # (a refusal leaves no directory, resolved.json or lock behind).
        writable_target(cfg.output_dir, "output_dir", directory=True)
        from overdrive.storage import lock

        lock.hold(cfg.output_dir, cfg.launch.machine_rank)  # one run per output_dir; the workers run under it
    force = getattr(args, "force", False)
    if not in_worker and getattr(args, "preflight", False):
        from overdrive.launch.preflight import preflight

        preflight(resolved)  # a failure is a UserError: exit 2 before anything trains
    if in_worker:
        return _train_here(resolved, force, in_worker=True)
    return _start(resolved, force)


def _train_here(resolved, force: bool, in_worker: bool) -> int:
    from overdrive.training.loop import train

    result = train(resolved, force=force)
    if result.stopped_by:
        from overdrive.launch import workers

        # Under a launcher, the launcher says how to resume (_start): one line, not one per process.
        if result.is_main_process and not (in_worker and workers.needs_launcher(resolved.config)):
            _how_to_resume(result.checkpoint, result.stopped_by, in_worker)
        return 128 + result.stopped_by
    if result.is_main_process and resolved.config.logging.level != "quiet":
        _summary(result, resolved.config, resolved.items)
    if result.eval_failed:
        if result.is_main_process:
            _evaluation_failed(result)
        return 1
    return 1 if result.stopped_early else 0


def _evaluation_failed(result) -> None:
    """The closing evaluation failed after the model was saved: said in one message, no traceback."""
    from overdrive.config.redact import redact_text
    from overdrive.training.benchmark_eval import LOG

    out = result.output_dir
    print(f"overdrive: the run trained and saved its model in {out}, but its closing evaluation "
          f"failed: {redact_text(result.eval_failed)}\n  the traceback is in {out / LOG}; evaluate the saved "
          f"model again with `overdrive eval {out} --tasks ...` once the cause is fixed", file=sys.stderr)


def _start(resolved, force: bool) -> int:
    """Train here, or start the workers (several processes, or one on the GPUs in launch.gpu_ids).
    The resume is judged here, once, so a refusal is one message before anything starts, and a
    new world size reaches the workers with its accumulation (handed over in the resolved file)."""
    from overdrive import checkpoint
    from overdrive.checkpoint import judge_resume
    from overdrive.launch import workers

    resolved = judge_resume(resolved, force)
    from overdrive.checkpoint.finished import finished

    done = finished(resolved)
    if done:
        print(f"overdrive: {done}")
        _train_further(resolved.config)
        return 0
    code = workers.run_on_ranks(resolved, "train", lambda here: _train_here(here, force, in_worker=False),
                                *(["--force"] if force else []))
    if code and workers.needs_launcher(resolved.config):
        found = checkpoint.latest_complete(checkpoint.checkpoints_dir(resolved.config.output_dir), checksums=False)
        _how_to_resume(found.found.path if found.found else None, code - 128 if code > 128 else 0, False)
    return code


def _train_further(cfg: RunConfig) -> None:
    """The command the finished run's message offers, written out: the same one with a larger max_steps."""
    import shlex

    from overdrive.config.redact import redact_text

    steps = cfg.training.max_steps
    if steps:
        command = shlex.join(["overdrive", *sys.argv[1:], f"training.max_steps={2 * steps}"])
        print(f"  to train further here (to step {2 * steps}): {redact_text(command)}")


def _how_to_resume(path, signum: int, in_worker: bool) -> None:
    import shlex

    from overdrive.checkpoint import signal_name

    why = f"stopped by {signal_name(signum)}" if signum else "the job failed"
    where = f"the last checkpoint is {path}" if path else "there is no checkpoint yet"
    if in_worker:
        print(f"overdrive: {why}; {where}. Run the same command again to resume.", file=sys.stderr)
    else:
        from overdrive.config.redact import redact_text

        command = redact_text(shlex.join(["overdrive", *sys.argv[1:]]))
        print(f"overdrive: {why}; {where}. To resume, run the same command again:\n  {command}", file=sys.stderr)


def _objective_lines(out) -> list[str]:
    """What the objective optimises beside its loss, at the first and last log points (TRL's names), from
    metrics.jsonl: a preference run's rewards and margins, an RL run's reward, distillation's divergence
    and agreement with the teacher (metrics.OBJECTIVE_REPORTED, where logged)."""
    from overdrive.training import metrics

    path = metrics.path_in(out)
    logged = [r for r in metrics.read(path).records if "loss" in r] if path.is_file() else []
    def number(record: dict, name: str) -> bool:  # a value not finite is logged as null
        return isinstance(record.get(name), (int, float))

    names = [n for n in metrics.OBJECTIVE_REPORTED if logged and number(logged[-1], n)]
    if not names:
        return []
    first = {name: next(r[name] for r in logged if number(r, name)) for name in names}
    return [f"{name} {first[name]:.4f} -> {logged[-1][name]:.4f}" for name in names]


def _summary(result, cfg: RunConfig, items=None) -> None:
    from overdrive.commands.next_steps import next_lines
    from overdrive.commands.run_listing import listing

    out = result.output_dir
    lines = [""]
    if result.first_loss is not None:
        lines.append(f"loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.steps} steps, "
                     f"{result.elapsed_s:.0f}s, {result.tokens_per_s:,.0f} tokens/s")
    lines += _objective_lines(out)
    if result.eval:
        lines.append("eval: " + "  ".join(f"{k} {v:.4g}" for k, v in result.eval.items()))
    lines += [
        f"run directory: {out}",
        f"  {listing(cfg, out)}",
        "next:",
        *next_lines(cfg, out, items or []),
    ]
    print("\n".join(lines))
