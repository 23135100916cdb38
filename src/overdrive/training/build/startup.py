"""What happens before the first step, said as it starts: nothing stays silent for more than a
few seconds (importing torch, reading and tokenizing the data, building the model, preparing it
with the strategy, compiling). Lines go to stderr, as every message; stdout stays the run's.

    say = startup.Stages(enabled=main and cfg.logging.level != "quiet")
    say("building the model")     # overdrive: [4.1 s] building the model
"""

from __future__ import annotations

import sys
import time

def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc), else since this module was imported."""
    try:
        import os

        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rpartition(")")[2].split()[19])
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


_STARTED = time.monotonic() - _process_age_s()


class Stages:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __call__(self, what: str) -> None:
        if self.enabled:
            print(f"overdrive: [{time.monotonic() - _STARTED:.1f} s] {what}", file=sys.stderr, flush=True)


def silent(what: str) -> None:
    """The Stages of a caller that says nothing (a tuner's trial, the bench)."""
