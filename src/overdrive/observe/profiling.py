"""`overdrive profile`, the part inside each rank: the training loop under torch.profiler,
through Accelerate's `Accelerator.profile(ProfileKwargs)`.

The run's own step timers (steps.py) split each measured step into phases; the profiler adds
what host clocks cannot see: how much of forward, backward and optimizer the main thread
spent inside collectives (ZeRO-3 and FSDP gather parameters in forward), told apart by the
phase ranges recorded as `record_function` spans. So, per optimizer step:

- communication = the loop's own collectives (sync) + the gradient reduction the rank
  waited for after its last gradient (or, if larger, the exposed collectives the profiler
  saw in backward) + the exposed collectives inside forward and optimizer; "exposed": in
  flight on any thread while the main thread ran no operator of its own;
- forward, backward, optimizer = their time minus that;
- data = waiting for the next batch; other = the rest of the step.

Each rank writes `<profile_dir>/phases.rank<N>.json` and its traces: TensorBoard's profiler
format (`tensorboard/rank<N>.*.pt.trace.json`) and the same Chrome trace JSON under a plain
name (`trace.rank<N>.json`) for Perfetto or chrome://tracing.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

from overdrive.observe.run import RunObserver

COLLECTIVE = re.compile(r"(gloo|nccl|c10d)[:_]|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
                        r"barrier|\bsend\b|\brecv\b|sendrecv", re.IGNORECASE)
# Host-side staging around a collective (FSDP2's `all_gather_copy_in`, `..._copy_out`): copies, not communication.
STAGING = re.compile(r"copy_in|copy_out", re.IGNORECASE)
NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)
PHASE_PREFIX = "phase:"
TOP_OPS = 10


def trace_path(profile_dir: Path, rank: int) -> Path:
    return Path(profile_dir) / f"trace.rank{rank}.json"


def measurement_path(profile_dir: Path, rank: int) -> Path:
    return Path(profile_dir) / f"phases.rank{rank}.json"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (merged) intervals `a` not covered by the (merged) intervals `b`."""
    out: list[tuple[float, float]] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _on_device(event: Any) -> bool:
    return "CUDA" in str(getattr(event, "device_type", "")).upper()


def _is_collective(name: str) -> bool:
    return bool(COLLECTIVE.search(name)) and not STAGING.search(name)


def collective_seconds_by_phase(events: list[Any]) -> dict[str, float]:
    """Seconds of communication not hidden behind compute within each phase span.

    On CPU processes collectives run on the backend's own threads (gloo's `gloo:all_reduce`)
    as well as the main thread; they are exposed when the main thread is not computing
    meanwhile (no `aten::` operator of its own running). With CUDA kernels in the trace the
    device is what counts: NCCL's kernels are exposed where no other kernel runs beside them
    (the host only queued both), and each exposed stretch belongs to the last phase that began
    before it (the device runs behind the host that launched it). Pure: any objects with
    `name`, `thread`, `time_range` (microseconds) and, for kernels, `device_type` will do."""
    phases: dict[str, list[tuple[float, float]]] = {}
    main_thread = None
    for e in events:
        if e.name.startswith(PHASE_PREFIX):
            phases.setdefault(e.name[len(PHASE_PREFIX):], []).append((e.time_range.start, e.time_range.end))
            main_thread = e.thread
    kernels = [e for e in events if _on_device(e)]
    if kernels:
        comm = _union([(e.time_range.start, e.time_range.end) for e in kernels if NCCL_KERNEL.search(e.name)])
        busy = _union([(e.time_range.start, e.time_range.end) for e in kernels if not NCCL_KERNEL.search(e.name)])
        return _by_launching_phase(_minus(comm, busy), phases)
    comm = _union([(e.time_range.start, e.time_range.end) for e in events
                   if not e.name.startswith(PHASE_PREFIX) and _is_collective(e.name)])
    computing = _union([(e.time_range.start, e.time_range.end) for e in events
                        if e.thread == main_thread and e.name.startswith("aten::") and not _is_collective(e.name)])
    exposed = _minus(comm, computing)
    return {phase: _overlap(_union(spans), exposed) / 1e6 for phase, spans in phases.items()}


def _by_launching_phase(exposed: list[tuple[float, float]], phases: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    starts = sorted((start, phase) for phase, spans in phases.items() for start, _ in spans)
    seconds = dict.fromkeys(phases, 0.0)
    for start, end in exposed:
        earlier = [phase for begun, phase in starts if begun <= start]
        if earlier:
            seconds[earlier[-1]] += (end - start) / 1e6
    return seconds


def top_ops(profiler: Any, steps: int, cuda: bool) -> list[dict[str, Any]]:
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [a for a in profiler.key_averages() if not a.key.startswith(PHASE_PREFIX)]
    rows.sort(key=lambda a: getattr(a, key, 0.0), reverse=True)
    return [{"name": a.key, "self_s_per_step": getattr(a, key, 0.0) / 1e6 / max(steps, 1),
             "calls_per_step": a.count / max(steps, 1)} for a in rows[:TOP_OPS]]


def split_phases(per_step: dict[str, float], comm: dict[str, float], step_s: float) -> dict[str, float]:
    """The contract's six phases from the timers' per-step seconds and the profiler's
    collective seconds per step in each phase."""
    in_backward = max(per_step.get("grad_wait_s", 0.0), comm.get("backward", 0.0))
    phases = {
        "data": per_step["data_s"],
        "forward": max(per_step["forward_s"] - comm.get("forward", 0.0), 0.0),
        "backward": max(per_step["backward_s"] - in_backward, 0.0),
        "optimizer": max(per_step["optimizer_s"] - comm.get("optimizer", 0.0), 0.0),
        "communication": per_step["sync_s"] + in_backward + comm.get("forward", 0.0) + comm.get("optimizer", 0.0),
    }
    phases["other"] = max(step_s - sum(phases.values()), 0.0)
    return phases


class ProfilingObserver(RunObserver):
    """The run's observer, with the profiler around `warmup + steps` optimizer steps."""

    def __init__(self, output_dir, accelerator, profile_dir: Path, warmup: int, steps: int, peak_memory_mb=None):
        super().__init__(output_dir, accelerator)
        self.peak_memory_mb = peak_memory_mb or (lambda device: 0.0)  # telemetry's, given by the command
        self.profile_dir, self.warmup, self.steps = Path(profile_dir), warmup, steps
        self.cuda = accelerator.device.type == "cuda"
        self._context = None
        self._profiler = None
        self._span = None
        self._t0: Optional[float] = None
        self.result: dict[str, Any] = {}

    def __enter__(self) -> "ProfilingObserver":
        super().__enter__()
        from accelerate.utils import ProfileKwargs
        from torch.profiler import tensorboard_trace_handler

        tensorboard = tensorboard_trace_handler(str(self.profile_dir / "tensorboard"),
                                                worker_name=f"rank{self.acc.process_index}")

        def ready(profiler):
            # A trace can be saved once: TensorBoard's handler saves it, and the same file is
            # the Chrome trace JSON Perfetto opens, copied under a plain name.
            before = set((self.profile_dir / "tensorboard").glob("*.json"))
            tensorboard(profiler)
            saved = sorted(set((self.profile_dir / "tensorboard").glob("*.json")) - before)
            if saved:
                shutil.copyfile(saved[-1], trace_path(self.profile_dir, self.acc.process_index))
            self._analyse(profiler)

        handler = ProfileKwargs(activities=["cpu", "cuda"] if self.cuda else ["cpu"], on_trace_ready=ready,
                                schedule_option={"wait": max(self.warmup - 1, 0), "warmup": 1 if self.warmup else 0,
                                                 "active": self.steps, "repeat": 1, "skip_first": 0},
                                profile_memory=False)
        self._context = self.acc.profile(handler)
        self._profiler = self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close_span()
        if self._context is not None:
            self._context.__exit__(*exc)
        super().__exit__(*exc)
        if self.result and not exc[0]:
            self.write()

    def _close_span(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None

    def enter(self, phase: str) -> None:
        super().enter(phase)
        import torch

        self._close_span()
        self._span = torch.profiler.record_function(PHASE_PREFIX + phase)
        self._span.__enter__()

    def step_done(self, step: int) -> None:
        super().step_done(step)
        done = step  # the profile run starts from scratch (checkpoint.resume=never)
        if done == self.warmup:
            self.recorder.read()  # the warm-up steps are not measured
            self._t0 = time.perf_counter()
        elif done == self.warmup + self.steps and self._t0 is not None:
            self.result["step_s"] = (time.perf_counter() - self._t0) / self.steps
            self.result["per_step"] = self.recorder.read().per_step()
        self._close_span()  # a span must not cross the profiler's step boundary
        self._profiler.step()

    def _analyse(self, profiler: Any) -> None:
        self.result["comm"] = {k: v / self.steps for k, v in collective_seconds_by_phase(profiler.events()).items()}
        self.result["top_ops"] = top_ops(profiler, self.steps, self.cuda)

    def write(self) -> None:
        step_s = self.result["step_s"]
        phases = split_phases(self.result["per_step"], self.result.get("comm", {}), step_s)
        record = {"rank": self.acc.process_index, "host": socket.gethostname(), "step_s": step_s, "phases": phases,
                  "peak_memory_bytes": int(self.peak_memory_mb(self.acc.device) * 2**20), "steps": self.steps,
                  "top_ops": self.result.get("top_ops", []), "timers": self.result["per_step"]}
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        measurement_path(self.profile_dir, self.acc.process_index).write_text(json.dumps(record, indent=1))
