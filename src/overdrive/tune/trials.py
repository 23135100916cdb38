"""One trial: a candidate trained for a few steps in a fresh process, watched from outside.

The tuner never trains in its own process. Each trial is a new process that runs the same
code path as `overdrive train` on the candidate's fully resolved config (nothing is
re-resolved, as with the launcher's workers), with every step logged to metrics.jsonl. The
tuner reads that file while the trial runs, and it alone decides when the trial ends: when
the measurement is complete, when the search says the candidate is hopeless, when the
process dies (a crash or an out-of-memory kill, recorded with the log's last lines), or when
no step arrives in time (a hang). It then kills the trial's whole process tree, launcher
workers included, so nothing a trial started outlives it.

How a trial process starts (forked from a warm server, or a fresh interpreter) is
processes.py's business.

Warm-up steps are not timed. A trial first-step time includes torch.compile's compilation,
so compile cost is measured, not guessed: see `Measurement.overhead_s`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.memory import mentions_out_of_memory
from overdrive.training import metrics

@dataclass(frozen=True)
class Rung:
    """A measurement milestone: reached after `min_steps` timed steps that took at least
    `min_seconds` (or after `max_steps`, for very fast steps), or once timed steps took
    `cap_seconds` if there are `floor_steps` of them: a candidate ten times slower than the
    rest is known to be slow well before its 20th step."""

    min_steps: int
    min_seconds: float
    max_steps: int
    cap_seconds: Optional[float] = None
    floor_steps: int = 3


@dataclass(frozen=True)
class TrialPlan:
    warmup_steps: int = 3
    rungs: tuple[Rung, ...] = (Rung(3, 15.0 / 9, 30), Rung(8, 15.0 / 3, 100, 15.0, 4), Rung(20, 15.0, 300, 45.0, 5))
    startup_timeout_s: float = 600.0
    """Until the first step: model build, data, and torch.compile's compile time."""
    stall_timeout_s: float = 120.0
    """Between steps (or 30 median steps, if longer)."""
    runner: str = "fork"
    poll_s: float = 0.1

    @classmethod
    def measuring(cls, seconds: float, **kwargs: Any) -> "TrialPlan":
        """Rungs for a complete measurement of `seconds` of timed steps (at least 20 steps),
        reached through 1/9 and 1/3 of it: each rung is three times longer than the last."""
        rungs = (Rung(3, seconds / 9, 30), Rung(8, seconds / 3, 100, seconds, 4),
                 Rung(20, seconds, 300, 3 * seconds, 5))
        return cls(rungs=rungs, **kwargs)

    @property
    def max_steps(self) -> int:
        return self.warmup_steps + self.rungs[-1].max_steps + 2

    def overrides(self, output_dir: Path) -> dict[str, Any]:
        """What every trial sets: log every step, no evaluation, checkpoint or tracker."""
        return {
            "training.max_steps": self.max_steps, "training.log_every_steps": 1, "training.eval_every_steps": None,
            "checkpoint.enabled": False, "checkpoint.save_final_model": False, "checkpoint.every_steps": None,
            "checkpoint.resume": "never",
            "logging.trackers": ["none"], "logging.progress": False, "logging.level": "quiet",
            "output_dir": str(output_dir),
        }

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("poll_s")
        return out


@dataclass
class Measurement:
    warmup_steps: int = 3
    steps: int = 0
    warmup_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # timed steps, after warm-up
    step_tokens: int = 0
    losses: list[float] = field(default_factory=list)
    peak_memory_mb: Optional[float] = None
    rung_steps: list[int] = field(default_factory=list)  # timed steps when each rung was reached
    _tokens: int = 0
    _step: int = 0

    def add(self, record: dict[str, Any]) -> None:
        """One training record of metrics.jsonl (written every step by the trial)."""
        tokens, rate = record.get("tokens"), record.get("tokens_per_s")
        if tokens is None or not rate:
            return
        steps = max(int(record["step"]) - self._step, 1)
        seconds = (tokens - self._tokens) / rate
        per_step, self.step_tokens = seconds / steps, (tokens - self._tokens) // steps
        self._tokens, self._step = tokens, int(record["step"])
        for _ in range(steps):
            self.steps += 1
            if self.steps <= self.warmup_steps:
                self.warmup_s += per_step
            else:
                self.step_s.append(per_step)
        self.losses.append(float(record["loss"]))
        if record.get("peak_memory_mb") is not None:
            self.peak_memory_mb = max(self.peak_memory_mb or 0.0, float(record["peak_memory_mb"]))

    def reached(self, rung: Rung) -> bool:
        n, seconds = len(self.step_s), sum(self.step_s)
        if rung.cap_seconds is not None and n >= rung.floor_steps and seconds >= rung.cap_seconds:
            return True
        return n >= rung.min_steps and (seconds >= rung.min_seconds or n >= rung.max_steps)

    def median_step_s(self, upto: Optional[int] = None) -> float:
        times = self.step_s[:upto] if upto else self.step_s
        return statistics.median(times) if times else 0.0

    def tokens_per_s(self, upto: Optional[int] = None) -> float:
        """Median over the timed steps: one slow step (another process, the OS) moves it little."""
        step = self.median_step_s(upto)
        return self.step_tokens / step if step else 0.0

    def overhead_s(self, upto: Optional[int] = None) -> float:
        """Warm-up time beyond what its steps take at steady speed: compilation, first-touch
        allocation, loader start-up. Paid once per run."""
        return max(0.0, self.warmup_s - self.warmup_steps * self.median_step_s(upto))

    def run_tokens_per_s(self, run_steps: int, upto: Optional[int] = None) -> float:
        """Tokens/s over a whole run of `run_steps` steps, the one-off overhead included."""
        step = self.median_step_s(upto)
        if not step:
            return 0.0
        return run_steps * self.step_tokens / (self.overhead_s(upto) + run_steps * step)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        return cls(**{k: v for k, v in data.items() if not k.startswith("_")})


@dataclass
class Outcome:
    status: str  # ok stopped crashed oom timeout
    reason: str = ""
    measurement: Optional[Measurement] = None
    log_tail: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------ processes

def run_resolved(path: str) -> int:
    """Train a resolved config file exactly as `overdrive train` does (the trial entry point)."""
    from overdrive.resolving import Resolved
    from overdrive.boundary import run_reporting_errors

    resolved = Resolved.from_json(Path(path).read_text())
    return run_reporting_errors(_train, resolved)


def _train(resolved) -> int:
    from overdrive.launch.workers import run_on_ranks

    return run_on_ranks(resolved, "train", _train_here)


def _train_here(resolved) -> int:
    from overdrive.training.loop import train

    result = train(resolved)
    if result.stopped_by:  # stopped by a signal after a checkpoint: not finished (as `overdrive train` says)
        return 128 + result.stopped_by
    return 1 if result.stopped_early else 0


def prepare_data(path: str) -> int:
    """Build the tokenizer and the token cache once, before any trial is timed."""
    from overdrive import data
    from overdrive.resolving import Resolved
    from overdrive.training.build.tokenizer import build_tokenizer

    cfg = Resolved.from_json(Path(path).read_text()).config
    data.prepare(cfg, build_tokenizer)
    return 0


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _failure(code: int, tail: str) -> tuple[str, str]:
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    if code == -9 or mentions_out_of_memory(tail):
        return "oom", f"out of memory (exit {code}){': ' + last if last else ''}"
    return "crashed", f"exit {code}{': ' + last[:200] if last else ''}"


def prepare(resolved_json: str, workdir: Path, starter, timeout_s: float = 3600.0) -> Outcome:
    """Fill the data caches (tokenizer, token ids) in a child process, so no trial pays for it."""
    workdir.mkdir(parents=True, exist_ok=True)
    path, log = workdir / "prepare.json", workdir / "prepare.log"
    path.write_text(resolved_json)
    started = time.monotonic()
    process = starter.start("prepare", path, log)
    try:
        while (code := process.poll()) is None:
            if time.monotonic() - started > timeout_s:
                return Outcome("timeout", f"preparing the data took over {timeout_s:.0f} s", log_tail=_tail(log))
            time.sleep(0.1)
    finally:
        process.kill()
    tail = _tail(log)
    return Outcome("ok" if code == 0 else "crashed", "" if code == 0 else _failure(code, tail)[1], log_tail=tail,
                   seconds=time.monotonic() - started)


Decide = Callable[[int, Measurement], Optional[str]]


def run_trial(resolved_json: str, workdir: Path, plan: TrialPlan, starter, decide: Optional[Decide] = None) -> Outcome:
    """Run one trial until its measurement is complete, the search stops it, or it fails.

    `decide(rung, measurement)` is asked at every rung but the last: a returned reason stops
    the trial there (successive halving), None lets it run on. `resolved_json` must already
    carry `plan.overrides(workdir / "out")`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    path, log = workdir / "trial.json", workdir / "trial.log"
    path.write_text(resolved_json)
    tail = metrics.Tail(metrics.path_in(workdir / "out"))
    m = Measurement(warmup_steps=plan.warmup_steps)
    started = last_step = time.monotonic()
    rung = 0
    try:
        process = starter.start("train", path, log)
    except RuntimeError as error:  # the fork server died: a crash of this trial, reported as such
        return Outcome("crashed", str(error)[:300], m)

    def done(status: str, reason: str = "", with_log: bool = False) -> Outcome:
        return Outcome(status, reason, m, _tail(log) if with_log else "", time.monotonic() - started)

    try:
        while True:
            code = process.poll()  # before reading: lines written just before an exit are still read
            records = [r for r in tail.records() if "loss" in r]  # training records only
            for record in records:
                m.add(record)
            now = time.monotonic()
            if records:
                last_step = now
            while rung < len(plan.rungs) and m.reached(plan.rungs[rung]):
                m.rung_steps.append(len(m.step_s))
                rung += 1
                if rung == len(plan.rungs):
                    return done("ok")
                reason = decide(rung - 1, m) if decide else None
                if reason:
                    return done("stopped", reason)
            if code is not None:
                if code == 0:
                    return done("crashed", f"ended after {m.steps} steps, before its measurement was complete", True)
                return done(*_failure(code, _tail(log)), with_log=True)
            if m.steps == 0 and now - started > plan.startup_timeout_s:
                return done("timeout", f"no training step within {plan.startup_timeout_s:g} s", True)
            stall = max(plan.stall_timeout_s, 30 * m.median_step_s())
            if m.steps and now - last_step > stall:
                return done("timeout", f"hung: no step for {stall:g} s after step {m.steps}", True)
            time.sleep(plan.poll_s)
    finally:
        process.kill()
