"""`overdrive launch SCRIPT -c CONFIG [args...]`: a user's own Accelerate script, configured.

The script's bare `Accelerator()` picks up the configured strategy, mixed precision and
accumulation from the environment Accelerate reads, on any number of processes and
machines, on CPU too (where `accelerate launch` cannot start several processes without
mpirun).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", action="append", default=[], metavar="FILE",
                        help="run config (overdrive, Accelerate or DeepSpeed file); repeat to layer several")
    parser.add_argument("-s", "--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. -s launch.num_processes=2")
    parser.add_argument("--print-env", action="store_true",
                        help="print the Accelerate variables the script would get, and exit")
    parser.add_argument("--worker", metavar="RESOLVED", help=argparse.SUPPRESS)
    parser.add_argument("script", help="the Python script to run on every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from overdrive.launch import user_script as launch
    from overdrive.errors import UserError

    if args.worker:
        return launch.run_user_script(args.worker, args.script, args.script_args)
    if not Path(args.script).is_file():
        raise UserError(f"script not found: {args.script}")
    from overdrive.config import resolve

    resolved = resolve(args.config, cli=args.set)
    if args.print_env:
        env = launch.user_script_env(resolved.config, Path(resolved.config.output_dir) / "launch")
        for key in sorted(env):
            if key.startswith(("ACCELERATE_", "FSDP_", "DS_", "OMP_", "MASTER_")):
                print(f"{key}={env[key]}")
        return 0
    return launch.launch_script(resolved, args.script, args.script_args)
