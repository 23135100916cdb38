"""A job's processes live and die together: no worker outlives its launcher.

The chain on each machine is launcher -> elastic agent -> workers. `overdrive train` (or
`overdrive launch`) starts the agent as a child (workers.run_agent); torch's agent starts
every worker in a session of its own (its SubprocessHandler passes start_new_session), so a
signal to the launcher's process group (`kill -9 -PGID`, a process manager, the out-of-memory
killer taking the group, a terminal hang-up) reaches the launcher and the agent but never
the workers, which would otherwise go on training with parent 1.

So every child follows its own parent, by a mechanism that cannot be missed:

- the kernel's parent-death signal (Linux PR_SET_PDEATHSIG, through prctl): SIGTERM the
  moment the parent exits, however it exits. Set at start, then the parent is compared with
  the pid the parent announced in the environment: a parent that died before the request was
  made is noticed too (the child has been handed to another process by then).
- a watcher thread blocked on a pidfd of the parent (or, where the platform has neither, one
  checking the parent every half second), which also keeps the bound below.

What SIGTERM then does is each process's own stop: the agent (torch's) passes it to its
workers and kills them `AGENT_STOP_TIMEOUT` seconds later; overdrive's loop stops at the next
step boundary with a complete checkpoint (checkpoint/signals.py); a user's script runs its
own handler, or ends at once without one. Once the parent is gone nobody would send the
final SIGKILL, so a worker's watcher does: `launch.stop_timeout` seconds after its parent
went, it kills its own process.

"Launcher gone" for the agent is overdrive's launcher process (its parent); for a worker it
is the agent (its parent). Either death ends everything below it on that machine.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

# Set by each parent for its children: the pid a child should find as its parent.
LAUNCHER_PID = "OVERDRIVE_LAUNCHER_PID"  # overdrive's launcher, for the agent
AGENT_PID = "OVERDRIVE_AGENT_PID"  # the agent, for the workers
# torch's agent waits this long between the SIGTERM and the SIGKILL it sends its workers
# (PContext.close's default, torch 2.13).
AGENT_STOP_TIMEOUT = 30

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(signum: int) -> bool:
    """Ask the kernel for `signum` when this process's parent exits. False where the
    platform has no such request (anything but Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _expected_parent(variable: str) -> Optional[int]:
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() else None


def follow_parent(variable: str, stop_timeout: Optional[float] = None) -> Optional[threading.Thread]:
    """End this process promptly when its parent (the pid in `variable`) is gone.

    SIGTERM reaches this process when the parent exits (or at once, if it already has);
    `stop_timeout`: seconds after that at which the process kills itself, for processes
    nobody else will kill (a worker whose agent is gone). Returns the watcher thread, or None
    when this process was not started by overdrive's launcher (the variable is absent).
    """
    expected = _expected_parent(variable)
    if expected is None:
        return None
    has_signal = parent_death_signal(signal.SIGTERM)
    watcher = _ParentWatcher(expected, signal_sent=has_signal, stop_timeout=stop_timeout)
    if os.getppid() != expected:
        # The parent died before the request above was made: it will never fire.
        watcher.parent_gone()
        return None
    watcher.start()
    return watcher


class _ParentWatcher(threading.Thread):
    """Waits for the parent to exit; then SIGTERM (where the kernel did not send it) and,
    after `stop_timeout`, SIGKILL to this process."""

    def __init__(self, parent: int, signal_sent: bool, stop_timeout: Optional[float]):
        super().__init__(name="overdrive-parent-watcher", daemon=True)
        self.parent, self.signal_sent, self.stop_timeout = parent, signal_sent, stop_timeout
        self._pidfd = self._open_pidfd(parent)

    @staticmethod
    def _open_pidfd(pid: int) -> Optional[int]:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None
        # Opened after the parent may have died and its pid been reused: still our parent?
        if os.getppid() != pid:
            os.close(fd)
            return None
        return fd

    def run(self) -> None:
        if self._pidfd is not None:
            import select

            select.select([self._pidfd], [], [])  # readable once the process has exited
            os.close(self._pidfd)
        else:
            stopped = threading.Event()
            while os.getppid() == self.parent:
                stopped.wait(0.5)
        self.parent_gone()

    def parent_gone(self) -> None:
        print(f"overdrive: pid {os.getpid()}: its launcher (pid {self.parent}) is gone; stopping"
              + (f" (killed in {self.stop_timeout:g} s if not done)" if self.stop_timeout is not None else ""),
              file=sys.stderr, flush=True)
        if not self.signal_sent or threading.current_thread() is threading.main_thread():
            os.kill(os.getpid(), signal.SIGTERM)
        if self.stop_timeout is None:
            return
        if threading.current_thread() is threading.main_thread():
            # Found at start (nothing to save yet): SIGTERM's handler, if any, has run.
            os._exit(128 + signal.SIGTERM)
        threading.Event().wait(self.stop_timeout)
        os.kill(os.getpid(), signal.SIGKILL)


def follow_agent(stop_timeout: float) -> Optional[threading.Thread]:
    """In a worker: end with the agent that started it, killed `stop_timeout` s after."""
    return follow_parent(AGENT_PID, stop_timeout=stop_timeout)


def follow_launcher() -> Optional[threading.Thread]:
    """In the agent: end with the launcher that started it (torch's agent handles the SIGTERM
    by stopping its workers, and kills them AGENT_STOP_TIMEOUT s later), and tell the workers
    it starts which pid to follow."""
    watcher = follow_parent(LAUNCHER_PID)
    os.environ[AGENT_PID] = str(os.getpid())
    return watcher


def launcher_env() -> dict[str, str]:
    """Variables the launcher hands the agent: its own pid, for the agent to follow."""
    return {LAUNCHER_PID: str(os.getpid())}

