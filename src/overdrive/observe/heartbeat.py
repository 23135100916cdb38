"""Heartbeats: each rank's step record, written to a small file at most once a second.

Two files per rank under `<output_dir>/observe/`:
- `rank<N>.live`: a few bytes the rank's StepRecorder writes through a shared memory map
  whenever it changes phase (no system call): step, phase, a progress counter. Exact and
  current for a reader on the same machine.
- `rank<N>.heartbeat.json`: written by a daemon thread once a second: the same record plus
  host and pid. The thread keeps writing while the main thread waits inside a collective
  (gloo and NCCL release the GIL there), so a waiting rank stays visibly alive; a frozen
  rank (SIGSTOP, a native call holding the GIL) stops writing, and its file goes stale.
  Readers on other machines (a shared output_dir) see this one.

Each rank also registers `faulthandler` on SIGUSR1, writing every thread's Python stack to
`rank<N>.stacks.txt` beside it: the watchdog sends the signal and reads what came back.
"""

from __future__ import annotations

import faulthandler
import json
import mmap
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from overdrive.storage.whole_file import replace_whole

DIR_NAME = "observe"
STACK_SIGNAL = signal.SIGUSR1
INTERVAL_S = 1.0


def directory(output_dir: str | Path) -> Path:
    return Path(output_dir).expanduser() / DIR_NAME


def heartbeat_path(output_dir: str | Path, rank: int) -> Path:
    return directory(output_dir) / f"rank{rank}.heartbeat.json"


def live_path(output_dir: str | Path, rank: int) -> Path:
    return directory(output_dir) / f"rank{rank}.live"


def stacks_path(output_dir: str | Path, rank: int) -> Path:
    return directory(output_dir) / f"rank{rank}.stacks.txt"


@dataclass
class Beat:
    """One rank's last heartbeat, as another process reads it."""

    rank: int
    local_rank: int
    host: str
    pid: int
    step: int
    phase: str
    phase_since: float
    progress: int
    written: float  # time.time() of the write
    grads_ready_s_ago: Optional[float] = None
    world_size: int = 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Beat":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


class Heartbeat:
    """The writer thread of one rank. A context manager: started on entry, stopped on exit."""

    def __init__(self, recorder: Any, output_dir: str | Path, rank: int, local_rank: int, world_size: int,
                 interval_s: float = INTERVAL_S):
        self.recorder, self.rank, self.interval = recorder, rank, interval_s
        self.path = heartbeat_path(output_dir, rank)
        self.identity = {"rank": rank, "local_rank": local_rank, "world_size": world_size,
                         "host": socket.gethostname(), "pid": os.getpid()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stacks: Optional[Any] = None
        self._live: Optional[mmap.mmap] = None

    def __enter__(self) -> "Heartbeat":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._register_stacks()
        self._map_live()
        self.write()
        self._thread = threading.Thread(target=self._run, name="overdrive-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.write(finished=True)
        except OSError:
            pass
        if self._stacks is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stacks.close()
        if self._live is not None:
            self.recorder.live = None
            self._live.close()

    def _map_live(self) -> None:
        from overdrive.observe.steps import LIVE

        path = live_path(self.path.parent.parent, self.identity["rank"])
        with open(path, "wb") as f:  # a new file each run: a reader never sees the last run's state
            f.write(b"\0" * LIVE.size)
        with open(path, "r+b") as f:
            self._live = mmap.mmap(f.fileno(), LIVE.size)
        self.recorder.live = self._live
        self.recorder._publish()

    def _register_stacks(self) -> None:
        # Only from the main thread, and only if nobody else claimed the signal.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(STACK_SIGNAL) not in (signal.SIG_DFL, None):
            return
        self._stacks = open(stacks_path(self.path.parent.parent, self.rank), "a")
        faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.write()
            except OSError:  # a full or vanished disk must not kill the rank; the watchdog sees staleness
                pass

    def write(self, finished: bool = False) -> None:
        record = {**self.identity, **self.recorder.state(), "written": time.time()}
        if finished:
            record["phase"] = "finished"
        replace_whole(self.path, json.dumps(record))  # readers see the old beat or the new one, never half


def read_beats(output_dir: str | Path, since: float = 0.0) -> dict[int, Beat]:
    """Every rank's last heartbeat written at or after `since` (older files are another run's)."""
    found: dict[int, Beat] = {}
    folder = directory(output_dir)
    if not folder.is_dir():
        return found
    for path in folder.glob("rank*.heartbeat.json"):
        try:
            beat = Beat.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if beat.written >= since:
            found[beat.rank] = _with_live(beat, live_path(output_dir, beat.rank))
    return found


def _with_live(beat: Beat, path: Path) -> Beat:
    """The heartbeat with step, phase and progress from the live map when this machine has it."""
    from overdrive.observe.steps import LIVE, STATES

    if beat.phase == "finished":
        return beat
    for _ in range(5):
        try:
            data = path.read_bytes()
        except OSError:
            return beat
        if len(data) < LIVE.size:
            return beat
        progress, step, phase, since, again = LIVE.unpack_from(data)
        if progress == again and progress >= beat.progress and 0 <= phase < len(STATES):
            beat.progress, beat.step, beat.phase, beat.phase_since = progress, step, STATES[phase], since
            return beat
    return beat
