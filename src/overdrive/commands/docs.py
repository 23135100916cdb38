"""`overdrive docs`: write (or check) the generated config reference.

A file already at the target is replaced only when it is an earlier generated reference (its
header says so) or with --force: nothing a user wrote is overwritten without asking."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overdrive.errors import Problem, UserError

MARKER = "by `overdrive docs`; do not edit by hand."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="docs/config.md", help="where to write the reference")
    parser.add_argument("--check", action="store_true", help="exit 2 if the file differs from the schema")
    parser.add_argument("--force", action="store_true", help="replace the file even if it is not a generated reference")


def _generated(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return any(MARKER in f.readline() for _ in range(5))
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    from overdrive.config.reference import render
    from overdrive.storage import faults

    import overdrive
    from overdrive.storage.overlap import refuse_overlap

    text, path = render(), Path(args.output).expanduser()
    if not args.check:  # the reference is read from the package's schema: never written into it
        refuse_overlap({"-o/--output": path}, {"the overdrive package": Path(overdrive.__file__).parent})
    current = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
    if args.check:
        if current is None:
            raise UserError(Problem("", f"{path} is missing", fix="run `overdrive docs -o PATH` and commit the result"))
        if current != text:
            raise UserError(Problem("", f"{path} is stale", fix="run `overdrive docs` and commit the result"))
        print(f"{path} is up to date", file=sys.stderr)
        return 0
    if current == text:
        print(f"{path} is up to date", file=sys.stderr)
        return 0
    faults.keep_existing_files([path], args.force or (current is not None and _generated(path)))
    faults.writable_target(path, "-o/--output")
    faults.write_text(path, text, "-o/--output")
    print(f"wrote {path}", file=sys.stderr)
    return 0
