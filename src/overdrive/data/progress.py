"""How far tokenization is: a rich bar (MB of text, MB/s, time left) on a terminal, a line now and then elsewhere."""

from __future__ import annotations

import time
from typing import Optional


class TokenizeProgress:
    """Progress in the corpus' unit (bytes of a text file, rows of a table); speed always in MB of text."""

    def __init__(self, what: str, total: Optional[float], unit: str, done: float = 0.0, enabled: bool = True,
                 every_s: float = 5.0):
        from overdrive.console import get_console, is_interactive

        self.what, self.total, self.unit, self.enabled = what, total, unit, enabled
        self.start, self.done, self.text_bytes, self.first = time.perf_counter(), done, 0, done
        self.every_s, self.last_line = every_s, self.start
        self.console = get_console(quiet=not enabled)
        self.bar = None
        if enabled and is_interactive():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                                TextColumn("{task.fields[mb]:,.0f} MB  {task.fields[rate]:.2f} MB/s"),
                                TimeRemainingColumn(), console=self.console, transient=True)
            self.task = self.bar.add_task(what, total=total, completed=done, mb=0.0, rate=0.0)
            self.bar.start()
        elif enabled:  # no bar: the start said at once, then a line every `every_s`
            self.console.print(f"{what} ...")

    def rate(self) -> float:
        return self.text_bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)

    def remaining_s(self) -> Optional[float]:
        if not self.total or self.done <= self.first:
            return None
        per_unit = (time.perf_counter() - self.start) / (self.done - self.first)
        return max(self.total - self.done, 0.0) * per_unit

    def resume_at(self, units: float) -> None:
        """Where an interrupted tokenization stopped: counted as done, not in the speed."""
        self.done = self.first = units
        if self.bar is not None:
            self.bar.update(self.task, completed=units)

    def advance(self, units: float, text_bytes: int) -> None:
        self.done += units
        self.text_bytes += text_bytes
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, mb=self.text_bytes / 1e6, rate=self.rate())
        elif self.enabled and time.perf_counter() - self.last_line >= self.every_s:
            self.last_line = time.perf_counter()
            left = self.remaining_s()
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            self.console.print(f"{self.what}: {self.text_bytes / 1e6:,.0f} MB{share}, {self.rate():.2f} MB/s"
                               + (f", about {left:.0f} s left" if left is not None else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
