"""`overdrive launch [-c CONFIG] [-s KEY=VALUE] SCRIPT [script args...]`: a user's own script,
configured.

Everything after SCRIPT belongs to the script, as with `accelerate launch`: overdrive's own
options go before it. The script's bare `Accelerator()`, or the Accelerator a Transformers
Trainer (or TRL trainer) builds, gets the configured strategy, mixed precision and
accumulation, on any number of processes and machines, on CPU too (where `accelerate launch`
cannot start several processes without mpirun).
"""

from __future__ import annotations

import argparse

# Arguments given to the script that look meant for overdrive (it then runs with defaults).
OWN_OPTIONS = ("-c", "--config", "-s", "--set", "--print-env")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", action="append", default=[], metavar="FILE",
                        help="run config (overdrive, Accelerate or DeepSpeed file); repeat to layer several. "
                             "Before SCRIPT: what follows SCRIPT is the script's")
    parser.add_argument("-s", "--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. -s launch.num_processes=2")
    parser.add_argument("--print-env", action="store_true",
                        help="print the Accelerate variables the script would get, and exit")
    parser.add_argument("--worker", metavar="RESOLVED", help=argparse.SUPPRESS)
    from overdrive.commands.arguments import add_accelerate_default_argument

    add_accelerate_default_argument(parser)
    parser.add_argument("script", help="the Python script to run on every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the script (everything after SCRIPT)")


def misplaced_options(script_args: list[str]) -> list[str]:
    """The script's arguments that look like overdrive's own options or KEY=VALUE items."""
    from overdrive.config.keys import expand_alias, is_known

    found = []
    for arg in script_args:
        name = arg.split("=", 1)[0]
        if name in OWN_OPTIONS or ("=" in arg and not arg.startswith("-") and is_known(expand_alias(name))):
            found.append(arg)
    return found


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from overdrive.launch import user_script as launch
    from overdrive.errors import UserError

    if args.worker:
        return launch.run_user_script(args.worker, args.script, args.script_args)
    if not Path(args.script).is_file():
        raise UserError(f"script not found: {args.script}")
    misplaced = misplaced_options(args.script_args)
    if misplaced:
        print(f"overdrive: warning: the script's arguments include {' '.join(misplaced)}: everything after the script "
              f"is the script's, not overdrive's (as with `accelerate launch`), so overdrive runs with "
              f"{'only ' + ', '.join(args.config) if args.config else 'its defaults'}{' and -s items' if args.set else ''}. "
              f"To configure the run, put them before the script: "
              f"overdrive launch -c run.yaml -s key=value {args.script} [script args]", file=sys.stderr, flush=True)
    from overdrive.resolving import resolve

    resolved = resolve(args.config, cli=args.set, accelerate_default=not args.no_accelerate_default)
    if args.print_env:  # print and exit: nothing written, the paths those a launch would write
        import tempfile

        launch_dir = str((Path(resolved.config.output_dir) / "launch").resolve())
        with tempfile.TemporaryDirectory() as scratch:
            made = launch.user_script_env(resolved.config, Path(scratch))
            env = {key: value.replace(str(Path(scratch).resolve()), launch_dir) for key, value in made.items()}
        for key in sorted(env):
            if key.startswith(("ACCELERATE_", "FSDP_", "DS_", "OMP_", "MASTER_")):
                print(f"{key}={env[key]}")
        return 0
    return launch.launch_script(resolved, args.script, args.script_args)
