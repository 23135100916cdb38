"""User-facing errors: a clear message, exit code 2, no traceback."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Union


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input, phrased so they can fix it."""

    key: str
    message: str
    where: str = ""
    fix: str = ""

    def render(self) -> str:
        head = f"{self.key}: {self.message}" if self.key else self.message
        if self.where:
            head += f"  [{self.where}]"
        return head + (f"\n    fix: {self.fix}" if self.fix else "")


class UserError(Exception):
    """Bad input from the user. Carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem] | Problem | str, title: Optional[str] = None):
        if isinstance(problems, str):
            problems = [Problem("", problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems = list(problems)
        self.title = title or (
            "1 problem" if len(self.problems) == 1 else f"{len(self.problems)} problems"
        )
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"overdrive: {self.title}:"] if len(self.problems) > 1 or self.title else []
        lines += [f"  - {p.render()}" for p in self.problems]
        return "\n".join(lines)


def keep_existing_files(paths: Iterable[Union[str, Path, None]], force: bool) -> None:
    """Refuse, before any work, to write over files the user already has, unless --force."""
    existing = [Path(p) for p in paths if p is not None and Path(p).exists()]
    if existing and not force:
        raise UserError([Problem(str(p), "exists and would be overwritten",
                                 fix="pass --force to overwrite it, or write to another path") for p in existing])


def run_reporting_errors(function: Callable, *args) -> int:
    """Run a command; turn UserError into a message on stderr and exit code 2."""
    try:
        return int(function(*args) or 0)
    except UserError as error:
        print(error.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overdrive: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `overdrive estimate --json | head`: the reader left. Python's documented remedy:
        # point stdout at devnull so the interpreter's final flush does not fail again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
