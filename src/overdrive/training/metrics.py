"""`<output_dir>/metrics.jsonl`: its one writer and its one reader.

One JSON object per line, appended by the main process: train lines carry `step`, `loss`,
`lr`, `tokens_per_s`, `seq_len`, `micro_batch_size`, `mixed_precision`, `mfu` (and more);
eval lines carry `eval_loss`; with `training.loss_spike` train lines add `loss_spikes_skipped`; a step
redone by `training.oom_retry` adds a line of its own (`step`, `oom_retry`, `micro_batch_size`,
`gradient_accumulation_steps`). A value that is not finite (a NaN loss) is written as null. A run killed mid-write can leave a last line cut short, and a
file another process is still appending to can end in a partial line: readers skip both.

Pure (json and files only): `overdrive report`, `plan`, the tuner and bench read it without torch.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from overdrive.storage.faults import writing

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

FILE_NAME = "metrics.jsonl"
# A preference run's own fields (TRL's names; `eval_` before them on eval lines): what its progress
# lines show first, then what its report adds.
PREFERENCE_WATCHED = ("rewards/accuracies", "rewards/margins", "kl")
PREFERENCE_REPORTED = PREFERENCE_WATCHED + ("rewards/chosen", "rewards/rejected")
# What each objective optimises beside its loss, shown at the end of a run and in its report where logged:
# a preference run's rewards, an RL run's reward (its loss near zero says little), distillation's divergence
# and agreement with the teacher.
OBJECTIVE_REPORTED = PREFERENCE_REPORTED + ("reward", "reward_std", "distill/loss", "distill/top1_agreement")


def path_in(output_dir: str | Path) -> Path:
    return Path(output_dir).expanduser() / FILE_NAME


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (main process only)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        if enabled:
            with writing(self.path, "output_dir", what=FILE_NAME):
                self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        if self.enabled:
            with writing(self.path, "output_dir", what=FILE_NAME), self.path.open("a") as f:
                f.write(json.dumps(finite(record), allow_nan=False) + "\n")


def finite(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with NaN and inf as null: JSON has no NaN, and a file with one is not JSON to other readers
    (jq, a browser, pandas' strict mode); readers here take null as "no value", as `mfu` has always been."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


@dataclass
class Records:
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0  # not JSON objects: a line cut short by a killed run


def _parse(lines: list[str], into: Records) -> Records:
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            into.bad_lines += 1
            continue
        if isinstance(record, dict):
            into.records.append(record)
        else:
            into.bad_lines += 1
    return into


def read(path: str | Path) -> Records:
    """Every record of a metrics.jsonl (a missing file has none)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return Records()
    return _parse(text.splitlines(), Records())


class Tail:
    """The new complete records of a metrics.jsonl another process is appending to (read
    from the start again if the file gets shorter)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = Path(path), 0, ""

    def records(self) -> list[dict[str, Any]]:
        try:
            with self.path.open() as f:
                if self.offset > f.seek(0, 2):  # cut back (a resumed run returns to its checkpoint): read it again
                    self.offset, self.partial = 0, ""
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        *lines, self.partial = (self.partial + text).split("\n")
        return _parse(lines, Records()).records


@dataclass(frozen=True)
class MeasuredThroughput:
    tokens_per_s: float
    records: int
    path: str
    same_shape: bool  # measured at this run's world size, micro-batch and sequence length


def measured_throughput(cfg: RunConfig, micro_batch: int) -> Optional[MeasuredThroughput]:
    """Median tokens/s of the last logged steps in `<output_dir>/metrics.jsonl`, if any."""
    path = path_in(cfg.output_dir)
    records = [r for r in read(path).records if r.get("tokens_per_s")]
    if not records:
        return None
    # The first logged step includes compilation and warm-up: leave it out when there are more.
    recent = records[1:][-20:] if len(records) > 1 else records
    last = recent[-1]
    same = (last.get("num_processes", cfg.launch.num_processes) == cfg.launch.num_processes
            and last.get("micro_batch_size", micro_batch) == micro_batch
            and last.get("seq_len", cfg.data.max_length) == cfg.data.max_length)
    return MeasuredThroughput(statistics.median(r["tokens_per_s"] for r in recent), len(recent), str(path), same)
