"""Test hooks for the faults a long run looks after itself: `OVERDRIVE_FAULT_INJECT`.

Not config keys (a config describes a run, not an accident): people testing their own clusters
set the variable on the launcher, the workers inherit it.

    OVERDRIVE_FAULT_INJECT=oom:step=K:rank=R     rank R raises an out-of-memory error inside step K
    OVERDRIVE_FAULT_INJECT=oom-sampling:step=K:rank=R
                                                 the same while rank R samples (GRPO's, on-policy
                                                 distillation's generation) in step K
    OVERDRIVE_FAULT_INJECT=spike:step=K          step K's labels scrambled on every rank (a loss spike)
    OVERDRIVE_FAULT_INJECT=stall:step=K          checkpoint.async: step K's checkpoint written, never sealed
    OVERDRIVE_FAULT_INJECT=freeze:step=K         every rank stops after step K (logged, saved if due) until killed
    OVERDRIVE_FAULT_INJECT=oom:step=3:rank=1,spike:step=6   several, comma-separated

Each fires once per process: a redone step is not failed again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional

from overdrive.config.env_report import process_environment
from overdrive.errors import Problem, UserError

VARIABLE = "OVERDRIVE_FAULT_INJECT"
_FIELDS = {"oom": {"step", "rank"}, "oom-sampling": {"step", "rank"}, "spike": {"step"}, "stall": {"step"},
           "freeze": {"step"}}


@dataclass(frozen=True)
class Injection:
    """The faults asked for: the step (1-based optimizer step) of each, None when not asked."""

    oom_step: Optional[int] = None
    oom_rank: int = 0
    sampling_oom_step: Optional[int] = None  # out of memory while the rank samples (an online objective)
    sampling_oom_rank: int = 0
    spike_step: Optional[int] = None
    stall_step: Optional[int] = None  # the background write of this step's checkpoint holds before its seal
    freeze_step: Optional[int] = None  # the job stops here and waits to be killed: a machine lost at a known step


def parse(text: str) -> Injection:
    """`oom:step=K:rank=R`, `spike:step=K`, comma-separated; anything else is refused by name."""
    found: dict[str, dict[str, int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, *pairs = item.split(":")
        if kind not in _FIELDS:
            raise _bad(text, f"unknown fault {kind!r} (one of {', '.join(_FIELDS)})")
        values = {}
        for pair in pairs:
            name, _, value = pair.partition("=")
            if name not in _FIELDS[kind] or not value.isdigit():
                raise _bad(text, f"{kind} takes {', '.join(f'{n}=N' for n in sorted(_FIELDS[kind]))}, not {pair!r}")
            values[name] = int(value)
        if "step" not in values or values["step"] < 1:
            raise _bad(text, f"{kind} needs step=K (K >= 1, an optimizer step)")
        found[kind] = values
    oom, sampling_oom, spike = found.get("oom", {}), found.get("oom-sampling", {}), found.get("spike", {})
    return Injection(oom_step=oom.get("step"), oom_rank=oom.get("rank", 0), sampling_oom_step=sampling_oom.get("step"),
                     sampling_oom_rank=sampling_oom.get("rank", 0), spike_step=spike.get("step"),
                     stall_step=found.get("stall", {}).get("step"), freeze_step=found.get("freeze", {}).get("step"))


def _bad(text: str, why: str) -> UserError:
    return UserError(Problem(VARIABLE, f"{text!r}: {why}",
                             fix="e.g. OVERDRIVE_FAULT_INJECT=oom:step=3:rank=1 or spike:step=5 (docs/checkpoints.md, fault hooks)"))


def from_environment(environ: Optional[Mapping[str, str]] = None) -> Injection:
    """The faults this process was asked to inject (none without the variable)."""
    return parse(process_environment(environ).get(VARIABLE, ""))


def freeze_after(injection: Injection, step: int) -> None:
    """`freeze:step=K`: after step K, wait to be killed (SIGKILL, as a lost machine): a kill-and-
    resume rehearsal lands at a known step however fast the steps run."""
    if injection.freeze_step == step:
        while True:
            time.sleep(3600)
