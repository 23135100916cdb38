"""`overdrive docs`: write (or check) the generated config reference."""

from __future__ import annotations

import argparse
from pathlib import Path

from overdrive.errors import Problem, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="docs/config.md", help="where to write the reference")
    parser.add_argument("--check", action="store_true", help="exit 2 if the file differs from the schema")


def run(args: argparse.Namespace) -> int:
    from overdrive.config.reference import render

    text, path = render(), Path(args.output)
    if args.check:
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            raise UserError(Problem("", f"{path} is stale", fix="run `overdrive docs` and commit the result"))
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0
