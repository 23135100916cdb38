"""The `overdrive` command: parses argv and hands off to one function per command.

Each command lives in `overdrive.commands.<name>` with `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only for the command that runs, so
`overdrive --help` and `overdrive explain` never pay for torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from overdrive import __version__
# name -> (module, one-line help). Order is the order shown in --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("overdrive.commands.train", "train a model from a run config (bare: the embedded default)"),
    "explain": ("overdrive.commands.explain", "every effective value and the layer that set it"),
    "plan": ("overdrive.commands.plan", "batch math, steps, memory per device and step time, before launch"),
    "estimate": ("overdrive.commands.estimate", "memory per device for every strategy (meta device, no weights)"),
    "docs": ("overdrive.commands.docs", "write the config reference (docs/config.md) from the schema"),
    "config": ("overdrive.commands.config_wizard", "interactive wizard that writes a commented run config"),
    "env": ("overdrive.commands.env", "versions, hardware, Accelerate default config and run variables, for bug reports"),
    "report": ("overdrive.commands.report", "plots and a markdown summary of a finished run"),
    "compare": ("overdrive.commands.compare", "config and metric differences between two runs"),
    "launch": ("overdrive.commands.launch", "run your own Accelerate script with the configured strategy, on any process count"),
    "export": ("overdrive.commands.export", "write the Accelerate YAML and DeepSpeed JSON for the same run"),
    "import": ("overdrive.commands.import_config", "turn Accelerate, DeepSpeed, Axolotl, LLaMA-Factory and torchtune configs into an overdrive config"),
    "eval": ("overdrive.commands.eval", "lm-evaluation-harness tasks on a run's model, a saved model or an adapter"),
    "generate": ("overdrive.commands.generate", "a run's model or adapter answers a prompt (interactive on a terminal)"),
    "distill-cache": ("overdrive.commands.distill_cache", "the distillation teacher's top-k over the data, stored once so train never loads the teacher"),
    "merge": ("overdrive.commands.merge", "merge a PEFT adapter into its base model and save it (no run needed)"),
    "slurm": ("overdrive.commands.slurm", "write an sbatch script for the same run"),
    "preflight": ("overdrive.commands.preflight", "check a job before training: rendezvous, bandwidth, shared output_dir, same versions and config"),
    "profile": ("overdrive.commands.profile", "where each step's time goes, per rank: the bottleneck and the key to change"),
    "k8s": ("overdrive.commands.k8s", "write Kubernetes manifests (TrainJob, PyTorchJob or JobSet) for the same run"),
    "skypilot": ("overdrive.commands.skypilot", "write a SkyPilot task YAML for the same run"),
    "tune": ("overdrive.commands.tune", "measure candidate layouts on this machine and write the fastest as tuned.yaml"),
    "sweep": ("overdrive.commands.sweep", "search any config keys with Optuna, every trial a real run; resumable, shareable"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overdrive",
        description="One declarative config for a whole training run, passed into Accelerate, "
        "DeepSpeed ZeRO and FSDP2: validated, explained, tuned and run.",
    )
    parser.add_argument("--version", action="version", version=f"overdrive {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    sub.add_parser("help", help="help COMMAND: that command's options and examples", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "help":  # `overdrive help train` is `overdrive train --help`
        argv = [argv[1], "--help"] if len(argv) > 1 and argv[1] in COMMANDS else ["--help"]
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        from overdrive.boundary import run_reporting_errors
        from overdrive.commands.typed_hints import unknown_command

        def refuse() -> int:
            raise unknown_command(argv[0], list(COMMANDS))

        return run_reporting_errors(refuse)
    if not argv or argv[0] not in COMMANDS:
        # Unknown commands and --help/--version are argparse's job.
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
    name = argv[0]
    from overdrive.launch.tools import installed_tools_first

    installed_tools_first()  # before anything starts a process
    from overdrive.boundary import run_reporting_errors
    from overdrive.storage import faults

    command = " ".join(["overdrive", *argv])
    outcome: dict = {}

    def parse_and_run() -> int:
        from overdrive.commands.typed_hints import HintingParser

        module = importlib.import_module(COMMANDS[name][0])
        command_parser = HintingParser(prog=f"overdrive {name}", description=COMMANDS[name][1])
        command_parser.argv = argv[1:]
        module.add_arguments(command_parser)
        # Intermixed: `overdrive train run.yaml --print-launch lr=3e-4` keeps all its items.
        try:
            args = command_parser.parse_intermixed_args(argv[1:])
        except TypeError:  # a command ending in SCRIPT ARGS... (`overdrive launch`) cannot intermix
            args = command_parser.parse_args(argv[1:])
        outcome["worker"] = bool(getattr(args, "resolved", None))
        with faults.thread_faults() as held:  # a library thread's full disk: said once, below
            code = module.run(args)
        if held:
            raise held[0]
        return code

    # One boundary for every command: a user error is a message and exit code 2, a write
    # fault (full disk, read-only, quota) the same, anything unforeseen one line naming the
    # file that holds the traceback (see errors.py).
    code = run_reporting_errors(parse_and_run, command=command, translate=faults.as_user_error)
    if outcome.get("worker"):
        exit_worker(code)
    return code


def exit_worker(code: int) -> None:
    """A launched worker whose work is done and saved leaves without interpreter finalisation.

    Native teardown of gloo / DeepSpeed state intermittently aborts (SIGABRT) after a
    successful run, and the elastic agent would then report the whole job as failed.
    Exit handlers still run (they flush logs and trackers); only finalisation is skipped.
    """
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
