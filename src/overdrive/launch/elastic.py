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


# Lines of the root cause's traceback printed: the exception and the frames nearest to it.
TRACEBACK_LINES = 12


def _error_text(failure: Any) -> tuple[str, str]:
    """(message, traceback) a worker wrote to its elastic error file, or empty strings."""
    data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if not isinstance(data, dict):
        return "", ""
    return str(data.get("message") or ""), str((data.get("extraInfo") or {}).get("py_callstack") or "")


def left_early(error: Any, local_world: Optional[int]) -> list[int]:
    """Ranks of this machine that the failure record does not hold: they had already exited
    with code 0 when the failure came (the agent stops only the ranks still running). A rank
    that ends its run while its peers are still in a collective breaks that collective: it is
    the cause the peers' "Connection closed by peer" points at."""
    if not local_world:
        return []
    any_failure = next(iter(error.failures.values()))
    offset = next(iter(error.failures)) - any_failure.local_rank  # this machine's first global rank
    return [offset + local for local in range(local_world) if offset + local not in error.failures]


def describe(error: Any, local_world: Optional[int] = None) -> str:
    """A ChildFailedError as a sentence: which rank, how it ended, its error's last lines
    (from the error file the worker wrote), and what happened to the rest; with `local_world`
    (the processes started on this machine), the ranks that had left before, named."""
    rank = first_failure(error.failures)
    failure = error.failures[rank]
    message, callstack = _error_text(failure)
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    elif message or callstack:
        how = f"exited with code {failure.exitcode}"
    elif failure.exitcode > 128:  # overdrive's loop stopping on a signal, after its checkpoint
        signum = failure.exitcode - 128
        name = signal.Signals(signum).name if signum in set(signal.Signals) else f"signal {signum}"
        how = f"stopped on {name} (exit {failure.exitcode})"
    else:
        how = f"exited with code {failure.exitcode} (its error is printed above)"
    lines = [f"overdrive: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}, host {socket.gethostname()}) "
             f"{how}; the other ranks were stopped and the job failed."]
    if callstack:
        tail = callstack.rstrip().splitlines()[-TRACEBACK_LINES:]
        lines += ["  " + line for line in tail]
    elif message:
        lines += ["  " + line for line in message.splitlines()]
    others = sorted(r for r in error.failures if r != rank)
    if others:
        lines.append("  also ended: " + ", ".join(_other(error.failures[r], r, message) for r in others))
    gone = left_early(error, local_world)
    if gone:
        lines.append("  left before it: " + ", ".join(f"rank {r}" for r in gone) + " (exit 0: ended its run while "
                     "this rank was still working; a rank waiting for it in a collective then fails with "
                     "'Connection closed by peer')")
    return "\n".join(lines)


def _other(failure: Any, rank: int, message: str) -> str:
    if failure.exitcode < 0:
        return f"rank {rank} ({failure.signal_name()})"
    same = message and _error_text(failure)[0] == message
    return f"rank {rank} (exit {failure.exitcode}{', the same error' if same else ''})"


def _local_world(args: Any) -> Optional[int]:
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):  # "auto", "gpu": counted by the agent, not known here
        return None


def exit_code(error: Any) -> int:
    """2 when the first failure was bad input reported by overdrive in the worker, else 1."""
    return 2 if error.failures[first_failure(error.failures)].exitcode == 2 else 1


_RENDEZVOUS_ERRORS = ("DistNetworkError", "DistStoreError", "RendezvousError", "RendezvousConnectionError",
                      "RendezvousTimeoutError", "RendezvousClosedError", "RendezvousStateError")


def rendezvous_failure(error: BaseException, args: Any) -> Optional[str]:
    """A failure of the rendezvous (the store's port taken, the store unreachable) as one line
    naming the port and launch.main_process_port, or None for any other error."""
    chain: list[BaseException] = []
    seen: Optional[BaseException] = error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if not any(type(e).__name__ in _RENDEZVOUS_ERRORS for e in chain):
        return None
    return _rendezvous_line(next((str(e) for e in chain if "EADDRINUSE" in str(e)), str(chain[-1])), args)


def worker_rendezvous_failure(error: Any, args: Any) -> Optional[str]:
    """A worker that failed in the rendezvous (its process group's store): the same one line,
    instead of its traceback."""
    message, callstack = _error_text(error.failures[first_failure(error.failures)])
    text = message + "\n" + callstack
    # Not a bare DistNetworkError: gloo raises it too when a peer dies in a collective, whose
    # cause is that peer, said by describe().
    marks = ("EADDRINUSE", "TCPStore", "DistStoreError", "RendezvousError", "RendezvousConnectionError",
             "RendezvousTimeoutError")
    if not any(mark in text for mark in marks):
        return None
    lines = [line for line in text.splitlines() if any(mark in line for mark in marks)]
    return _rendezvous_line(lines[-1].split(":", 1)[-1] if lines else message, args)


def _rendezvous_line(reason: str, args: Any) -> str:
    endpoint = getattr(args, "rdzv_endpoint", "") or ""
    port = endpoint.rpartition(":")[2] if endpoint else str(getattr(args, "master_port", "") or "")
    where = f"port {port}" if port not in ("", "0") else "the port the rendezvous took for itself"
    busy = "EADDRINUSE" in reason
    what = (f"{where} was taken by another job before the rendezvous could bind it" if busy
            else f"the rendezvous on {where} failed: {(reason.strip().splitlines() or [''])[0][:200]}")
    fix = ("choose a free port, or remove launch.main_process_port: a one-machine job then takes a port no other "
           "job can take" if busy else "check launch.main_process_ip and launch.main_process_port on every machine")
    return f"overdrive: launch.main_process_port: {what}\n    fix: {fix}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from overdrive.launch import lifetime

    lifetime.follow_launcher()  # before torch's import: a launcher already gone ends this at once
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as error:
        said = worker_rendezvous_failure(error, args)
        print(said or describe(error, _local_world(args)), file=sys.stderr, flush=True)
        return 2 if said else exit_code(error)
    except SignalException as stop:
        # The agent has already passed the signal on to the workers and waited for them.
        return 128 + int(stop.sigval)
    except Exception as error:  # a rendezvous failure said by its port and key, never torch's traceback
        said = rendezvous_failure(error, args)
        if said is None:
            raise
        print(said, file=sys.stderr, flush=True)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
