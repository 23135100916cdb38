"""The hang watchdog: on each machine, beside the launcher, it reads the ranks' heartbeats.

A job is hung when no rank has made progress (changed phase or finished a step) for
`launch.hang_timeout_s`. Then the report names the rank(s) without progress and where each
was last seen, asks every rank on this machine for its Python stacks (SIGUSR1, answered by
faulthandler; a frozen rank cannot answer, and is said to be frozen), names what the
waiting ranks wait in, and stops this machine's workers with SIGKILL. The elastic agent
sees them die: the job ends non-zero, or `launch.max_restarts` starts it again from the last
checkpoint. Checkpoints are written to a temporary directory and renamed when complete
(checkpoint/store.py), so a kill never leaves a damaged one.

The same heartbeats say whether a machine left: `lost_machines()` (asked by elastic restarts).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from overdrive.observe.heartbeat import INTERVAL_S, STACK_SIGNAL, Beat, read_beats, stacks_path
from overdrive.observe.steps import WAITING

# A heartbeat older than this: the rank is not answering (frozen, or its machine is gone).
STALE_AFTER_S = max(5.0, 5 * INTERVAL_S)
STACK_WAIT_S = 3.0
POLL_S = 1.0


@dataclass
class RankView:
    beat: Beat
    silent_s: float  # seconds since its last heartbeat
    still_s: float  # seconds without progress, as the watchdog saw it

    @property
    def answering(self) -> bool:
        return self.silent_s < STALE_AFTER_S

    @property
    def waiting(self) -> bool:
        """In a collective: the loop's own, or the gradient reduction after its last gradient."""
        b = self.beat
        return self.answering and (b.phase in WAITING or (b.phase == "backward" and b.grads_ready_s_ago is not None))

    def where(self) -> str:
        b = self.beat
        text = f"step {b.step + 1} (after step {b.step}), phase {b.phase}"
        if b.phase == "backward" and b.grads_ready_s_ago is not None:
            text += f" (its gradients were ready {b.grads_ready_s_ago:.0f} s before; waiting for the gradient reduction)"
        elif b.phase == "sync":
            text += " (the loop's all-reduce: stop agreement / logged loss)"
        return text


@dataclass
class Hang:
    timeout_s: float
    stuck: list[RankView]
    waiting: list[RankView]
    missing: list[int] = field(default_factory=list)  # ranks never heard from in this attempt
    over_nccl: bool = False  # host phases say where a rank waits for its GPU, not which collective it is in


def judge(views: list[RankView], world_size: int, timeout_s: float, over_nccl: bool = False) -> Optional[Hang]:
    """A hang, or None. Pure: the views carry everything (tests build them by hand).

    Over NCCL collectives are queued on the GPU and the host runs ahead: a rank whose host is
    in `optimizer` may be waiting for an all-reduce its GPU is in, so answering ranks are not
    told apart by their host phase there (NCCL's timeout report and flight recorder do it)."""
    if not views or all(v.beat.phase == "finished" for v in views):
        return None
    live = [v for v in views if v.beat.phase != "finished"]
    if min(v.still_s for v in live) < timeout_s:
        return None  # someone made progress within the timeout
    missing = sorted(set(range(world_size)) - {v.beat.rank for v in views})
    # The stuck ranks: those that cannot answer; else those not waiting in a collective; else all.
    stuck = [v for v in live if not v.answering] or ([] if over_nccl else [v for v in live if not v.waiting]) or live
    waiting = [v for v in live if v not in stuck]
    return Hang(timeout_s, sorted(stuck, key=lambda v: v.beat.rank), sorted(waiting, key=lambda v: v.beat.rank),
                missing, over_nccl)


def process_state(pid: int) -> str:
    """'stopped' (SIGSTOP / SIGTSTP), 'gone', or '' (running or sleeping, or not knowable here)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return ""
    state = text.rsplit(")", 1)[-1].split()[0]
    return "stopped" if state in ("T", "t") else ""


def collect_stacks(output_dir: str | Path, beats: list[Beat], wait_s: float = STACK_WAIT_S) -> dict[int, str]:
    """Ask every rank on this machine for its Python stacks; rank -> text ('' = no answer)."""
    host = socket.gethostname()
    asked: dict[int, tuple[Path, int]] = {}
    for beat in beats:
        if beat.host != host:
            continue
        path = stacks_path(output_dir, beat.rank)
        size = path.stat().st_size if path.exists() else 0
        try:
            os.kill(beat.pid, STACK_SIGNAL)
        except (ProcessLookupError, PermissionError):
            continue
        asked[beat.rank] = (path, size)
    deadline = time.monotonic() + wait_s
    answers: dict[int, str] = {}
    while time.monotonic() < deadline and len(answers) < len(asked):
        time.sleep(0.1)
        for rank, (path, size) in asked.items():
            if rank not in answers and path.exists() and path.stat().st_size > size:
                time.sleep(0.2)  # let faulthandler finish writing
                with path.open() as f:
                    f.seek(size)
                    answers[rank] = f.read()
    return {rank: answers.get(rank, "") for rank in asked}


def main_thread_stack(dump: str) -> str:
    """The signalled (main) thread's frames from a faulthandler dump, the heartbeat thread dropped."""
    blocks = [b for b in dump.strip().split("\n\n") if b.strip()]
    current = [b for b in blocks if "Current thread" in b.splitlines()[0]]
    return (current or blocks[:1] or [""])[0]


def innermost_frame(stack: str) -> str:
    for line in stack.splitlines()[1:]:
        if line.strip().startswith("File "):
            return line.strip()
    return ""


def render(hang: Hang, stacks: dict[int, str]) -> str:
    lines = [f"overdrive: the job is hung: no rank made progress for {hang.timeout_s:.0f} s "
             f"(launch.hang_timeout_s={hang.timeout_s:g})."]
    for v in hang.stuck:
        b = v.beat
        if not v.answering:
            state = process_state(b.pid) if b.host == socket.gethostname() else ""
            why = f"no heartbeat for {v.silent_s:.0f} s" + (f", its process is {state}" if state else "")
        else:
            why = f"no progress for {v.still_s:.0f} s while the others wait"
        lines.append(f"  stuck: rank {b.rank} (host {b.host}, pid {b.pid}): {why}; last seen at {v.where()}")
    if hang.over_nccl:
        lines.append("  over NCCL a rank's phase is where its host waits for the GPU, not the collective its GPU is in: "
                     "NCCL's timeout report above and the flight recorder's dumps (<output_dir>/nccl_trace/) name the "
                     "collective and the ranks that did not join it")
    for rank in hang.missing:
        lines.append(f"  stuck: rank {rank}: never heard from in this attempt (another machine without a shared "
                     "output_dir, or it never reached the first step)")
    for v in hang.waiting:
        b = v.beat
        frame = innermost_frame(main_thread_stack(stacks.get(b.rank, "")))
        lines.append(f"  waiting: rank {b.rank} (host {b.host}, pid {b.pid}) at {v.where()}"
                     + (f"; innermost Python frame: {frame}" if frame else ""))
    for rank in sorted(stacks):
        dump = stacks[rank]
        if dump:
            lines.append(f"  Python stack of rank {rank} (most recent call first):")
            lines += ["    " + line for line in main_thread_stack(dump).splitlines()]
        else:
            lines.append(f"  rank {rank} did not answer the request for its stack (frozen or gone)")
    return "\n".join(lines)


def lost_machines(beats: dict[int, Beat], now: Optional[float] = None,
                  after_s: float = STALE_AFTER_S) -> dict[str, list[int]]:
    """Machines (host -> ranks) all of whose ranks stopped writing heartbeats `after_s` ago,
    while some other machine's ranks still write: the answer to "did a machine leave?"."""
    now = time.time() if now is None else now
    by_host: dict[str, list[Beat]] = {}
    for beat in beats.values():
        if beat.phase != "finished":
            by_host.setdefault(beat.host, []).append(beat)
    silent = {host: sorted(b.rank for b in group) for host, group in by_host.items()
              if all(now - b.written >= after_s for b in group)}
    return silent if len(silent) < len(by_host) else {}


class Watchdog:
    """A thread beside the elastic agent, for one attempt of the job on this machine."""

    def __init__(self, output_dir: str | Path, timeout_s: Optional[float], world_size: int,
                 say: Callable[[str], None], poll_s: float = POLL_S, over_nccl: bool = False):
        self.output_dir, self.timeout_s, self.world_size, self.say = output_dir, timeout_s, world_size, say
        self.over_nccl = over_nccl
        self.poll_s = poll_s
        self.since = time.time()
        self.hang: Optional[Hang] = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (progress counter, monotonic time it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="overdrive-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        if self.timeout_s is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def beats(self) -> dict[int, Beat]:
        return read_beats(self.output_dir, since=self.since)

    def lost_machines(self, after_s: float = STALE_AFTER_S) -> dict[str, list[int]]:
        """Machines whose every rank went silent during this attempt (see `lost_machines`)."""
        return lost_machines(self.beats(), after_s=after_s)

    def views(self) -> list[RankView]:
        now, mono = time.time(), time.monotonic()
        views = []
        for rank, beat in self.beats().items():
            counter = (beat.progress, beat.step)
            seen = self._seen.get(rank)
            if seen is None or seen[0] != counter:
                self._seen[rank] = seen = (counter, mono)
            views.append(RankView(beat, silent_s=now - beat.written, still_s=mono - seen[1]))
        return views

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            hang = judge(self.views(), self.world_size, self.timeout_s, self.over_nccl)
            if hang is None:
                continue
            self.hang = hang
            beats = [v.beat for v in hang.stuck + hang.waiting]
            stacks = collect_stacks(self.output_dir, beats)
            self.say(render(hang, stacks))
            self._stop_workers(beats)
            return

    def _stop_workers(self, beats: list[Beat]) -> None:
        host = socket.gethostname()
        for beat in beats:
            if beat.host == host:
                try:
                    os.kill(beat.pid, signal.SIGKILL)  # a frozen process ignores everything else
                except (ProcessLookupError, PermissionError):
                    pass
        self.say("overdrive: stopped this machine's workers of the hung job (SIGKILL)")
