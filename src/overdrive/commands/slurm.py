"""`overdrive slurm CONFIG [-o FILE]`: an sbatch script for the same run."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.explain import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("-o", "--output", metavar="FILE", help="write the script here (default: stdout)")
    parser.add_argument("--job-name", default="overdrive", help="SLURM job name")
    parser.add_argument("--force", action="store_true", help="overwrite the output file if it exists")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from overdrive.launch import workers as launch

    from overdrive.launch import lines as launch_lines
    from overdrive.commands.explain import resolve_from_args
    from overdrive.errors import keep_existing_files

    keep_existing_files((args.output,), args.force)
    resolved = resolve_from_args(args)
    from overdrive.strategies.cpu import target_gpus

    launch.check(resolved.config, gpus=target_gpus(resolved.config))  # the cluster's machines, not this one
    script = launch_lines.sbatch_script(resolved, args.job_name)
    if args.output:
        Path(args.output).write_text(script)
        Path(args.output).chmod(0o755)
        print(f"wrote {args.output}  (submit with: sbatch {args.output})")
    else:
        print(script, end="")
    return 0
