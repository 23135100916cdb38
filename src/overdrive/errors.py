"""User-facing errors: a clear message, exit code 2, no traceback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input, phrased so they can fix it."""

    key: str
    message: str
    where: str = ""
    fix: str = ""
    # Keys that answer this problem when a later layer sets them (a tool's file that cannot say
    # its data set: `overdrive import FILE data.source=...`); resolve() then drops it.
    settled_by: tuple[str, ...] = ()

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
