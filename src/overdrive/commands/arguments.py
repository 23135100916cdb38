"""The arguments several commands take, declared once: the config inputs (FILE and KEY=VALUE
items, --no-accelerate-default) and sizes in GiB."""

from __future__ import annotations

import argparse
import math

from overdrive.errors import Problem, UserError


def add_config_arguments(parser: argparse.ArgumentParser, items: bool = True) -> None:
    """The config inputs every command that resolves a config takes (`items=False`: a command
    that declares its own positionals, as plan's CONFIG and overrides)."""
    if items:
        parser.add_argument("items", nargs="*", metavar="FILE|KEY=VALUE",
                            help="config files (overdrive, Accelerate or DeepSpeed), then key=value overrides")
    add_accelerate_default_argument(parser)


def add_accelerate_default_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-accelerate-default", action="store_true",
                        help="ignore Accelerate's default_config.yaml")


def resolved_from(args: argparse.Namespace, tell: bool = True, checks=None, rules=None):
    """The Resolved config of the parsed config arguments (warnings told unless `tell` is false;
    `checks`: resolve's checks of the user's code and data; `rules`: the command's own checks,
    reported with the resolver's: resolving.resolve.Rules)."""
    from overdrive.resolving.inputs import resolve_items

    return resolve_items(args.items, accelerate_default=not getattr(args, "no_accelerate_default", False), tell=tell,
                         checks=checks, rules=rules)


def check_memory_sizes(args: argparse.Namespace) -> None:
    """--gpu-memory / --host-memory: a finite, positive number of GiB."""
    for name in ("--gpu-memory", "--host-memory"):
        value = getattr(args, name[2:].replace("-", "_"), None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise UserError(Problem(name, f"must be a positive number of GiB (got {value})", fix=f"e.g. {name} 80"))


def load_run(args, checks=None, rules=None):
    """(Resolved, in_worker) for a command's `items` (files and key=value) or `--resolved` (`checks`: resolve's
    checks of the user's code and data; `rules`: the command's own checks of the items' config; a worker's
    config was checked by its launcher)."""
    from overdrive.errors import UserError
    from overdrive.resolving.inputs import read_resolved, resolve_items

    if args.resolved:
        if args.items:
            raise UserError(f"--resolved carries the whole config; drop {' '.join(args.items)}")
        return read_resolved(args.resolved), True
    ignore_default = getattr(args, "no_accelerate_default", False)
    resolved = resolve_items(args.items, accelerate_default=not ignore_default, checks=checks, rules=rules)
    # The run's hints repeat them (commands/next_steps.py), the flag too: it changes the config.
    resolved.items = [*args.items, *(["--no-accelerate-default"] if ignore_default else [])]
    return resolved, False


def add_output_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """-o FILE and --force for a command whose output is one file (stdout without -o)."""
    parser.add_argument("-o", "--output", metavar="FILE", help=f"write the {what} here (default: stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite the -o file if it exists")


def not_over_items(outputs: dict, items) -> None:
    """No output of a command is, holds or lies inside a FILE it was given (storage/overlap.py),
    with or without --force."""
    from overdrive.storage.overlap import local_input, refuse_overlap

    refuse_overlap(outputs, {f"FILE {item}": local_input(item) for item in items or [] if "=" not in item})


def checked_output(args: argparse.Namespace) -> None:
    """Before any work: an -o file that is one of the command's files, exists (without --force)
    or cannot be written is refused."""
    from overdrive.storage import faults

    if args.output:
        not_over_items({"--output": args.output}, getattr(args, "items", None))
        args.output = str(faults.output_file(args.output, "--output", args.force))


def emit(text: str, args: argparse.Namespace) -> None:
    """The command's data: to the -o file (and `wrote FILE` on stderr), else on stdout."""
    import sys

    from overdrive.storage import faults

    if args.output:
        faults.write_text(args.output, text, "--output")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
