"""`sweep.space` read and checked against the schema: every entry a key the config has, and
every value it may take, refused by key before any trial starts.

    entries, problems = parse_space(cfg, chains)   # pure: no Optuna, no torch

An entry is a range `{low, high, log, step}` or a list of choices. A range is an integer
range when the key holds integers (`training.micro_batch_size`) and a float range when it
holds floats (`optim.lr`); a key that holds neither (a string, a literal) takes only a list.
Every endpoint and every choice is validated as the key's own value in the config being
loaded, so a range the key cannot take (`optim.lr: {low: 0, ...}`, `training.max_steps:
{low: 0.5, ...}`) is refused with the schema's reason, not found out by a crashed trial.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pydantic import TypeAdapter, ValidationError

from overdrive.config import keys
from overdrive.config.provenance import where
from overdrive.config.schema import RunConfig
from overdrive.config.schema_eval import is_benchmark_metric
from overdrive.config.schema_sweep import KNOWN_FIELDS
from overdrive.errors import Problem

RANGE_FIELDS = ("low", "high", "log", "step")
# Keys a trial may not take from the space: the sweep sets where each trial writes, and the
# sweep's own settings are not a trial's.
NOT_SEARCHABLE = ("output_dir", "sweep")


@dataclass(frozen=True)
class SpaceEntry:
    key: str  # the dotted config key (aliases expanded)
    kind: str  # "int", "float" or "choice"
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: tuple = ()

    def grid_count(self) -> Optional[int]:
        """How many values a grid visits, counted without listing them (None: a float range
        without a step)."""
        if self.kind == "choice":
            return len(self.choices)
        if self.step is None and self.kind == "float":
            return None
        return int(math.floor((self.high - self.low) / (self.step or 1) + 1e-9)) + 1

    def grid_points(self) -> Optional[list[Any]]:
        """Every value a grid visits, or None for a range without a step. Built only for a grid
        `sweep_rules` let through (at most MAX_GRID_POINTS)."""
        count = self.grid_count()
        if count is None or self.kind == "choice":
            return None if count is None else list(self.choices)
        step = self.step or 1
        return [self.low + i * step for i in range(count)]


# A grid is a list of every point (Optuna's GridSampler holds them all): beyond this a grid
# cannot be visited in any sweep, and listing it would only exhaust the memory.
MAX_GRID_POINTS = 1_000_000


def value_problem(cfg: RunConfig, key: str, value: Any) -> Optional[str]:
    """Why `key` cannot take `value` in this config (the schema's reason), or None."""
    data = cfg.model_dump(mode="python")
    keys.set_dotted(data, key, value)
    try:
        RunConfig.model_validate(data)
    except ValidationError as error:
        path = tuple(key.split("."))
        mine = [e for e in error.errors() if tuple(str(p) for p in e["loc"])[:len(path)] == path] or error.errors()
        return "; or ".join(dict.fromkeys(e["msg"] for e in mine))
    return None


def _numeric_kind(key: str, low: Any, high: Any, step: Any) -> Optional[str]:
    """"int" or "float" for a key that holds numbers, None for one that does not."""
    annotation = keys.annotation_for(key)
    if annotation is None:  # an open mapping's entry: the range's own numbers say which
        numbers = [v for v in (low, high, step) if v is not None]
        return "int" if all(isinstance(v, int) for v in numbers) else "float"
    adapter = TypeAdapter(annotation)

    def takes(value: Any) -> bool:
        try:
            adapter.validate_python(value)
            return True
        except (ValidationError, TypeError, ValueError):
            return False

    if takes(1.5):
        return "float"
    return "int" if takes(1) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _range(cfg: RunConfig, key: str, spec: Mapping[str, Any], name: str) -> tuple[Optional[SpaceEntry], list[str]]:
    unknown = [str(k) for k in spec if k not in RANGE_FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], RANGE_FIELDS, n=1)
        return None, [f"{unknown[0]!r} is not a range field{f' (did you mean `{close[0]}`?)' if close else ''}: "
                      "a range has low, high, log and step"]
    low, high, log, step = (spec.get(f) for f in RANGE_FIELDS)
    missing = [f for f, v in (("low", low), ("high", high)) if v is None]
    if missing or low is None or high is None:
        return None, [f"a range needs {' and '.join(missing)}"]
    bad = [f"{f} is {v!r}, not a number" for f, v in (("low", low), ("high", high), ("step", step))
           if v is not None and not _is_number(v)]
    if log is not None and not isinstance(log, bool):
        bad.append(f"log is {log!r}, not true or false")
    if bad:
        return None, bad
    kind = _numeric_kind(key, low, high, step)
    if kind is None:
        return None, [f"{name} does not hold numbers, so it takes no range: give a list of choices"]
    problems = []
    if kind == "int":
        for field, value in (("low", low), ("high", high), ("step", step)):
            if value is not None and float(value) != int(value):
                problems.append(f"{field} is {value!r}, but {name} holds whole numbers")
        if problems:
            return None, problems
        low, high, step = int(low), int(high), (int(step) if step is not None else None)
    else:
        low, high, step = float(low), float(high), (float(step) if step is not None else None)
    if low > high:
        problems.append(f"empty range: low {low!r} is above high {high!r}")
    if step is not None and step <= 0:
        problems.append(f"step is {step!r}: it must be above 0")
    if log and step is not None and step != 1:
        problems.append("a log range takes no step (Optuna samples it continuously in log space)")
    if log and low <= 0:
        problems.append(f"a log range needs low above 0, got {low!r}")
    for field, value in (("low", low), ("high", high)):
        why = value_problem(cfg, key, value)
        if why:
            problems.append(f"{field} {value!r} is a value {name} cannot take: {why}")
    if problems:
        return None, problems
    return SpaceEntry(key, kind, low, high, bool(log), step if not log else None), []


def _choices(cfg: RunConfig, key: str, values: list, name: str) -> tuple[Optional[SpaceEntry], list[str]]:
    if not values:
        return None, ["an empty list of choices"]
    problems = []
    for value in values:
        if value is not None and not isinstance(value, (bool, int, float, str)):
            problems.append(f"choice {value!r} is not a number, string, boolean or null (Optuna stores only those)")
            continue
        why = value_problem(cfg, key, value)
        if why:
            problems.append(f"choice {value!r} is a value {name} cannot take: {why}")
    if len(set(map(repr, values))) != len(values):
        problems.append("a choice is listed twice")
    return (None, problems) if problems else (SpaceEntry(key, "choice", choices=tuple(values)), [])


def parse_space(cfg: RunConfig, chains: Optional[Mapping] = None) -> tuple[list[SpaceEntry], list[Problem]]:
    """The entries of `sweep.space`, and every problem with them."""
    origin = where(chains, "sweep.space")
    entries: list[SpaceEntry] = []
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for raw, spec in cfg.sweep.space.items():
        key = keys.expand_alias(str(raw))
        label = f"sweep.space.{raw}"
        if not keys.is_known(key):
            kind = "is a section; name one of its keys" if key in keys.section_keys() else "unknown key" + keys.suggest(key)
            problems.append(Problem(label, kind, origin, "sweep.space takes dotted config keys, e.g. optim.lr"))
            continue
        if key.split(".")[0] in NOT_SEARCHABLE:
            problems.append(Problem(label, "cannot be searched: the sweep sets it for each trial", origin))
            continue
        if key in seen:
            problems.append(Problem(label, f"names {key} again (also as `{seen[key]}`)", origin, "keep one of them"))
            continue
        seen[key] = str(raw)
        if isinstance(spec, Mapping):
            entry, found = _range(cfg, key, spec, key)
        elif isinstance(spec, (list, tuple)):
            entry, found = _choices(cfg, key, list(spec), key)
        else:
            entry, found = None, [f"is {spec!r}: give a range {{low, high, log, step}} or a list of choices"]
        problems += [Problem(label, text, origin) for text in found]
        if entry is not None:
            entries.append(entry)
    return entries, problems


def grid_size(entries: list[SpaceEntry]) -> Optional[int]:
    """Points of the whole grid, counted (a product of counts), never listed."""
    size = 1
    for entry in entries:
        count = entry.grid_count()
        if count is None:
            return None
        size *= count
    return size


def sweep_rules(cfg: RunConfig, chains: Optional[Mapping] = None) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of the `sweep` section, for resolving/validate.py."""
    entries, errors = parse_space(cfg, chains)
    warnings: list[Problem] = []
    s = cfg.sweep
    if s.sampler == "grid" and not errors:
        unstepped = [e.key for e in entries if e.grid_count() is None]
        size = grid_size(entries)
        if unstepped:
            errors.append(Problem(f"sweep.space.{unstepped[0]}", "a float range without a step has no grid points",
                                  where(chains, "sweep.space"), "give it a step or a list, or use sweep.sampler=tpe"))
        elif size is not None and size > MAX_GRID_POINTS:
            errors.append(Problem("sweep.space", f"the grid has {size:,} points, more than a sweep can visit "
                                  f"(at most {MAX_GRID_POINTS:,})", where(chains, "sweep.space"),
                                  "give the ranges larger steps or fewer values, or use sweep.sampler=tpe"))
        elif entries and size is not None and s.trials > size:
            errors.append(Problem("sweep.trials", f"{s.trials} trials, but the grid has {size} points",
                                  where(chains, "sweep.trials"), f"set sweep.trials={size} or widen the grid"))
    if is_benchmark_metric(s.metric):
        errors += _benchmark_metric_problems(cfg, chains)
    elif s.metric not in KNOWN_FIELDS:
        close = difflib.get_close_matches(s.metric, KNOWN_FIELDS, n=1)
        warnings.append(Problem("sweep.metric", f"{s.metric!r} is not a field overdrive writes to metrics.jsonl"
                                + (f" (did you mean `{close[0]}`?)" if close else ""), where(chains, "sweep.metric"),
                                "a trial without it fails; known fields: " + ", ".join(KNOWN_FIELDS)))
    return errors, warnings


def _benchmark_metric_problems(cfg: RunConfig, chains: Optional[Mapping] = None) -> list[Problem]:
    """`sweep.metric: eval/<task>/<metric>` is written only by a run that runs that task: with no
    `eval.tasks`, or a task named there by neither its name nor a task file, every trial would fail."""
    task = cfg.sweep.metric.split("/")[1]
    tasks = cfg.eval.tasks
    files = [t for t in tasks if t.endswith((".yaml", ".yml"))]  # a file's task name is inside it
    if not tasks:
        return [Problem("sweep.metric", f"{cfg.sweep.metric!r} is a benchmark metric, but `eval.tasks` is empty",
                        where(chains, "sweep.metric"), f"add the task to eval.tasks (eval.tasks=[{task}])")]
    if task not in tasks and not files:
        return [Problem("sweep.metric", f"task {task!r} is not in eval.tasks ({', '.join(tasks)})",
                        where(chains, "sweep.metric"), f"add {task} to eval.tasks, or judge by one of them")]
    return []
