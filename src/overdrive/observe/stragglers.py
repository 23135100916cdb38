"""Stragglers: a rank whose compute time stays clearly above the others'.

Every rank does the same work per step, so in a healthy job their compute times (forward,
backward up to the last local gradient, optimizer: steps.py) are alike, and a slow rank
shows up as the others' waiting, not as their compute. A rank is named once its compute per
step has been at least `RATIO` times the median of the other ranks' for `WINDOWS` logging
windows in a row. Pure: the loop gathers the figures, this module judges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Optional, Sequence

RATIO = 1.25  # "clearly above": a quarter slower than the others' median
WINDOWS = 3  # "stays": this many logging windows in a row


@dataclass
class Straggler:
    rank: int
    host: str
    compute_s: float  # its compute per step, last window
    others_s: float  # the other ranks' median
    windows: int

    @property
    def ratio(self) -> float:
        return self.compute_s / max(self.others_s, 1e-12)

    def sentence(self) -> str:
        return (f"straggler: rank {self.rank} (host {self.host}) computes {self.compute_s:.3f} s per step against "
                f"{self.others_s:.3f} s on the other ranks ({self.ratio:.2f}x) for {self.windows} logs in a row; "
                "the others wait for it")


@dataclass
class StragglerWatch:
    hosts: Sequence[str]
    ratio: float = RATIO
    windows: int = WINDOWS
    _run: dict[int, int] = field(default_factory=dict)  # rank -> windows in a row above
    named: Optional[Straggler] = None

    def add(self, compute_s: Sequence[float]) -> Optional[Straggler]:
        """One window's compute per step of every rank; the straggler newly named, if any."""
        if len(compute_s) < 2:
            return None
        current = None
        for rank, value in enumerate(compute_s):
            others = median([v for r, v in enumerate(compute_s) if r != rank])
            if others > 0 and value >= self.ratio * others:
                self._run[rank] = self._run.get(rank, 0) + 1
                if self._run[rank] >= self.windows:
                    current = Straggler(rank, self.hosts[rank] if rank < len(self.hosts) else "?", value, others,
                                        self._run[rank])
            else:
                self._run[rank] = 0
        fresh = current is not None and (self.named is None or self.named.rank != current.rank)
        if current is not None:
            self.named = current
        return current if fresh else None

    def current(self) -> Optional[Straggler]:
        """The straggler as of the last window (None once it caught up)."""
        if self.named is not None and self._run.get(self.named.rank, 0) >= self.windows:
            return self.named
        return None
