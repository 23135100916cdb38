"""`overdrive train [FILES...] [key=value ...] [--resolved run.json]`

Bare, it trains the embedded default: a small GPT-2-style model from scratch on the Python
standard library's own source. With several processes configured it starts the workers,
each of which re-enters this command with `--resolved` and trains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--print-launch", action="store_true",
        help="print the equivalent torchrun, `accelerate launch` and srun command lines, and exit",
    )


def _load(args):
    from overdrive.config import Resolved, resolve
    from overdrive.errors import UserError

    files = [item for item in args.items if "=" not in item]
    cli = [item for item in args.items if "=" in item]
    if args.resolved:
        if args.items:
            raise UserError(f"--resolved carries the whole config; drop {' '.join(args.items)}")
        return Resolved.from_json(Path(args.resolved).read_text()), True
    resolved = resolve(files, cli=cli)
    for warning in resolved.warnings:
        print(f"overdrive: warning: {warning.render()}", file=sys.stderr)
    return resolved, False


def run(args: argparse.Namespace) -> int:
    resolved, in_worker = _load(args)
    cfg = resolved.config
    if getattr(args, "print_launch", False):
        from overdrive.launch import print_launch

        return print_launch(resolved)
    if not in_worker:
        # What this machine lacks (bf16, GPUs, ...) stops the run before anything starts;
        # workers skip it: the launcher checked the same resolved config.
        from overdrive.config import check_for_train

        check_for_train(resolved)
    if not in_worker and cfg.launch.num_processes > 1:
        from overdrive.launch import launch_workers

        return int(launch_workers(resolved) or 0)

    from overdrive.trainer import train

    result = train(resolved)
    if result.is_main_process and cfg.logging.level != "quiet":
        _summary(result, cfg)
    return 1 if result.stopped_early else 0


def _summary(result, cfg) -> None:
    out = result.output_dir
    lines = [""]
    if result.first_loss is not None:
        lines.append(f"loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.steps} steps, "
                     f"{result.elapsed_s:.0f}s, {result.tokens_per_s:,.0f} tokens/s")
    if result.eval:
        lines.append("eval: " + "  ".join(f"{k} {v:.4g}" for k, v in result.eval.items()))
    lines += [
        f"run directory: {out}",
        f"  metrics.jsonl, resolved.json{', model/ (save_pretrained)' if cfg.checkpoint.save_final_model else ''}",
        "next:",
        f"  overdrive report {out}                      # curves, throughput, memory",
        "  overdrive explain                              # every value of this run and where it came from",
        "  overdrive train lr=3e-4 training.max_steps=600  # any key can be set like this",
        "  overdrive train parallel.strategy=fsdp launch.num_processes=2   # the same run on 2 processes",
    ]
    if cfg.checkpoint.save_final_model:
        lines.append(f"  model.name_or_path={out / 'model'}              # start from the trained model")
    print("\n".join(lines))
