"""One run of a resolved config in a child process, watched from outside through its
metrics.jsonl: each new value of the metric is handed to `on_value` (which may stop the
run: pruning), and the run's value is the metric's last value in the file.

The child is what `overdrive train` runs (tune/trials.run_resolved: one process, or the
launcher with its workers for several), started by the tuner's starters (tune/processes.py:
forked from a warm server, or a fresh interpreter), killed with everything it started.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from overdrive.training import metrics

STOP_WAIT_S = 120.0  # a run asked to stop checkpoints first; after this long it is killed


@dataclass
class Execution:
    status: str  # finished, stopped (by on_value), interrupted, failed
    value: Optional[float] = None
    step: int = 0  # the last step the run logged
    reason: str = ""
    seconds: float = 0.0
    log: Optional[Path] = None


def number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def last_value(output_dir: Path, metric: str) -> tuple[Optional[float], list[str]]:
    """The metric's last value in a run's metrics.jsonl, and the fields the file has."""
    value, fields = None, set()
    for record in metrics.read(metrics.path_in(output_dir)).records:
        fields.update(k for k, v in record.items() if number(v) is not None)
        if number(record.get(metric)) is not None:
            value = number(record[metric])
    return value, sorted(fields)


def execute(resolved_json: str, output_dir: Path, starter, metric: str, *,
            on_value: Callable[[int, float], bool] = lambda step, value: False,
            on_start: Callable[[int], None] = lambda pid: None,
            tick: Callable[[], None] = lambda: None,
            interrupted: Callable[[], bool] = lambda: False,
            poll_s: float = 0.25) -> Execution:
    """Run the config (its output_dir is `output_dir`) to the end, or until `on_value(step,
    value)` returns True (killed: "stopped") or `interrupted()` does (asked to stop: it
    checkpoints first). `tick` is called while it runs."""
    from overdrive.tune.trials import _failure, _tail

    output_dir.mkdir(parents=True, exist_ok=True)
    path, log = output_dir / "trial.json", output_dir / "trial.log"
    path.write_text(resolved_json)
    tail = metrics.Tail(metrics.path_in(output_dir))
    started = time.monotonic()
    step = 0
    try:
        process = starter.start("train", path, log)
    except RuntimeError as error:  # the fork server died
        return Execution("failed", reason=str(error)[:300], log=log)
    on_start(process.pid)

    def done(status: str, reason: str = "", value: Optional[float] = None) -> Execution:
        return Execution(status, value, step, reason, time.monotonic() - started, log)

    try:
        while True:
            code = process.poll()  # before reading: lines written just before an exit are still read
            for record in tail.records():
                step = max(step, int(record.get("step") or 0))
                value = number(record.get(metric))
                if value is not None and on_value(int(record.get("step") or 0), value):
                    return done("stopped")
            if code is not None:
                break
            if interrupted():
                _stop(process)
                return done("interrupted", "the sweep was stopped")
            tick()
            time.sleep(poll_s)
    finally:
        process.kill()
    if code != 0:
        return done("failed", _failure(code, _tail(log))[1])
    value, fields = last_value(output_dir, metric)
    if value is None:
        return done("failed", f"no `{metric}` in its metrics.jsonl (fields written: {', '.join(fields) or 'none'})")
    return done("finished", value=value)


def _stop(process) -> None:
    """SIGTERM: the run saves a checkpoint after its step and exits (torchrun passes it on)."""
    try:
        os.kill(process.pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + STOP_WAIT_S
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
