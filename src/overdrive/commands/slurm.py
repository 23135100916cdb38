"""`overdrive slurm CONFIG [-o FILE]`: an sbatch script for the same run."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.arguments import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("-o", "--output", metavar="FILE", help="write the script here (default: stdout)")
    parser.add_argument("--job-name", default="overdrive", help="SLURM job name (letters, digits, . _ -)")
    parser.add_argument("--force", action="store_true", help="overwrite the output file if it exists")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from overdrive.launch import lines as launch_lines
    from overdrive.commands.arguments import resolved_from
    import re

    from overdrive.errors import Problem, UserError
    from overdrive.storage import faults

    # The name goes into an `#SBATCH --job-name=` line: a newline would start a shell line of
    # its own, and quotes, spaces or $ would be read by sbatch or the shell.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", args.job_name):
        raise UserError(Problem("--job-name", f"{args.job_name!r} is not a plain job name",
                                fix="use letters, digits, '.', '_' and '-' only (at most 128 characters)"))
    from overdrive.commands.arguments import checked_output

    checked_output(args)
    resolved = resolved_from(args)
    from overdrive.launch.job_checks import cluster_problems

    found = cluster_problems(resolved.config)  # the job is `overdrive train` on the cluster's machines
    if found:
        raise UserError(found, title="cannot launch")
    script = launch_lines.sbatch_script(resolved, args.job_name)
    if args.output:
        faults.write_text(args.output, script, "--output")
        Path(args.output).chmod(0o755)
        import sys

        print(f"wrote {args.output}  (submit with: sbatch {args.output})", file=sys.stderr)
    else:
        print(script, end="")
    return 0
