"""torch.distributed.run, ending with one line that names the rank that failed.

launch.py starts `python -m overdrive.launch.elastic <torchrun arguments> <worker command>`. The
agent is torch's own, with torchrun's arguments: it watches the workers every
`launch.monitor_interval` seconds, and when one dies it stops the others (SIGTERM, then
SIGKILL after its shutdown timeout) or, with `launch.max_restarts`, starts them all again
(they resume from the last checkpoint). Only the ending differs: instead of a Python
traceback of the agent, the first failure is summarised (rank, pid, signal or exit code)
and the exit code is 1, or 128 + the signal when the agent itself was told to stop.

Peers of a dead rank do not hang: gloo and NCCL see the dead peer's connections close, so
a collective they are waiting in fails at once, and the agent's SIGTERM reaches them within
a monitor interval anyway.
"""

from __future__ import annotations

import signal
import socket
import sys
from typing import Any, Optional, Sequence


def first_failure(failures: dict) -> int:
    """The rank whose failure came first. Ranks the agent itself stopped (SIGTERM) are the
    consequence, not the cause, even when the same second's timestamps cannot tell them apart."""
    causes = [rank for rank, f in failures.items() if f.exitcode != -signal.SIGTERM] or list(failures)
    # Within one second, a rank killed by a signal (SIGKILL, the OOM killer) is the cause and a
    # peer that then reported the broken collective and exited with an error the consequence.
    return min(causes, key=lambda rank: (failures[rank].timestamp, failures[rank].exitcode >= 0, rank))


def describe(error: Any) -> str:
    """A ChildFailedError as a sentence: which rank, how it ended, what happened to the rest."""
    rank = first_failure(error.failures)
    failure = error.failures[rank]
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode} (its error is printed above)"
    lines = [f"overdrive: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}, host {socket.gethostname()}) "
             f"{how}; the other ranks were stopped and the job failed."]
    others = sorted(r for r in error.failures if r != rank)
    if others:
        lines.append("  also ended: " + ", ".join(
            f"rank {r} ({error.failures[r].signal_name() if error.failures[r].exitcode < 0 else 'exit ' + str(error.failures[r].exitcode)})"
            for r in others))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as error:
        print(describe(error), file=sys.stderr, flush=True)
        return 1
    except SignalException as stop:
        # The agent has already passed the signal on to the workers and waited for them.
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
