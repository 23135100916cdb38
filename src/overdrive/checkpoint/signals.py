"""SIGTERM, SIGINT and SIGHUP: finish the step, save, leave.

Schedulers (SLURM, Kubernetes, spot instances) announce a preemption with SIGTERM and kill
a little later; torch.distributed.run forwards SIGTERM/SIGINT to every worker. The handler
only records the signal; the loop asks at the end of each step, where the model is
consistent and a checkpoint can be taken.

Ranks receive the signal at slightly different moments, possibly in different steps. They
must stop after the same step, or one would wait forever in the next step's collective for
the others: so the question "did anyone get a signal?" is itself an all-reduce, once per
step, on a CPU tensor over gloo. On a CPU run that is the process group itself; on GPUs it
is a side group, so the check does not wait for the device's queue (no host-device sync).
It costs one small message round per step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Optional

# SIGHUP: the terminal closed; the launcher and agent pass it on (a worker whose agent
# died gets SIGTERM from the kernel, launch/lifetime.py).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """Context manager: while active, SIGTERM/SIGINT/SIGHUP ask the loop to stop after this step.

    A second SIGINT (Ctrl-C twice) stops at once, as a user pressing it again expects.
    `answer(signum)`: what the process that speaks for the run says the moment a signal comes
    (the step it will stop after), `abandon()`: what it says on the second Ctrl-C (what was
    kept). A SIGINT within `same_press_s` of the first is the same press: a launched worker
    gets the terminal's and, a moment later, the copy its agent passes on.
    """

    def __init__(self, group: Any = None, world_size: int = 1, same_press_s: float = 1.5):
        self.received = 0
        self.group, self.world_size = group, world_size
        self._previous: dict[int, Any] = {}
        self.same_press_s = same_press_s
        self._first_at = 0.0
        self.answer: Optional[Callable[[int], str]] = None
        self.abandon: Optional[Callable[[], str]] = None

    def __enter__(self) -> "StopRequest":
        # Handlers can only be installed from the main thread (a notebook cell running the
        # trainer in a thread keeps Python's default behaviour).
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received and signum == signal.SIGINT:
            if time.monotonic() - self._first_at < self.same_press_s:
                return
            if self.abandon is not None:
                _say(self.abandon())
            raise KeyboardInterrupt
        if not self.received:
            self._first_at = time.monotonic()
            if self.answer is not None:
                _say(self.answer(signum))
        self.received = self.received or signum

    def agreed(self) -> int:
        """The signal any rank received (0: none). Every rank must call this at the same step."""
        if self.world_size <= 1:
            return self.received
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())


def stopping_note(signum: int, step: int, saving: bool) -> str:
    """The answer to a stop signal, the moment it comes."""
    what = "and saving" if saving else "(checkpoint.enabled is false: nothing is saved)"
    again = "; Ctrl-C again to stop now without a checkpoint" if signum == signal.SIGINT and saving else ""
    return f"overdrive: {signal_name(signum)}: stopping after step {step} {what}{again}"


def kept_note(found: Any) -> str:
    """The answer to the second Ctrl-C: what the run keeps (`found`: the newest complete
    checkpoint, or None)."""
    kept = f"the last checkpoint, {found}, is kept" if found else "no checkpoint was written yet"
    return f"overdrive: stopping now, without a checkpoint of this step; {kept}"


def _say(text: str) -> None:
    """A line on stderr from a signal handler: os.write, since the handler may have interrupted
    a print to the same stream (a buffered write re-entered raises)."""
    if text:
        try:
            os.write(2, (text.rstrip("\n") + "\n").encode(errors="replace"))
        except OSError:
            pass


def cpu_group() -> Optional[Any]:
    """A gloo group for small host-side agreements (None: the default group is gloo already,
    or there is no process group). Every rank must call this, in the same order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
