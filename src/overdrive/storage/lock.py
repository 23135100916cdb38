"""One run per output_dir: a lock the kernel releases when its holder dies.

`fcntl.flock` on `<output_dir>/.overdrive-lock`, held for the life of the process. The file
says who holds it (pid, host, start time, command) so a second run can name the first.
Nothing is left to clean up: a killed or crashed run's lock goes with its process (the
file stays, unlocked, and the next run takes it). On NFS, Linux carries flock over as a
POSIX lock, so two machines sharing the directory see each other too.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from overdrive.errors import Problem, UserError
from overdrive.storage.faults import writing

LOCK_NAME = ".overdrive-lock"
_held: dict[Path, int] = {}  # path -> fd, kept open (and locked) until the process ends


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process (it has not written its name yet)"
    started = info.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) + f" ({_ago(time.time() - started)} ago)"
            if isinstance(started, (int, float)) else "an unknown time")
    return f"pid {info.get('pid')} on {info.get('host')}, started {when}: {info.get('command', '')}".rstrip(": ")


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def hold(output_dir: str | Path, machine_rank: int = 0, command: Optional[str] = None) -> Path:
    """Take the output_dir's lock for this process, or refuse naming the run that holds it.

    Machines of one job each take their own (`.overdrive-lock.machine1`, ...): they share the
    directory by design; a second job on the same machine rank is what is refused.
    """
    folder = Path(output_dir).expanduser()
    path = folder / (LOCK_NAME if machine_rank == 0 else f"{LOCK_NAME}.machine{machine_rank}")
    if path in _held:
        return path
    with writing(path, "output_dir", what="the run lock"):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(Problem("output_dir", f"{folder} is in use by another run: {_holder(path)}",
                                fix="wait for that run to finish or stop it, or set output_dir to another "
                                "directory")) from None
    from overdrive.config.redact import redact_text

    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": redact_text(command or " ".join(["overdrive", *sys.argv[1:]]))}
    with writing(path, "output_dir", what="the run lock"):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    _held[path] = fd
    return path


def release(path: Path) -> None:
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the flock


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold `path`'s flock for the block, waiting for another holder: one process at a time
    reads-then-writes what a storage without row locks (SQLite) would let two both change."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
