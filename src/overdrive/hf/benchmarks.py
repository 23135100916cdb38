"""Benchmark tasks of lm-evaluation-harness on a model in memory: its own task registry (or
a task YAML file on disk), its `HFLM` wrapping the model, its `simple_evaluate`. Nothing of the
harness is re-implemented, so a task scores here as `lm-eval --model hf` scores it on the saved
model. For a run's evaluations (training/benchmark_eval.py) and `overdrive eval`.

lm-eval is an optional dependency (the `eval` extra), imported only when a task runs.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from overdrive.config.schema_eval import BENCHMARK_PREFIX
from overdrive.errors import Problem, UserError

INSTALL = "pip install 'lm-eval>=0.4.9' (or overdrive's eval extra: pip install 'overdrive[eval]')"


@dataclass(frozen=True)
class TaskSettings:
    """lm-eval's own arguments: rows per task (`--limit`), few-shot examples, batch size."""

    limit: Optional[float] = None
    num_fewshot: Optional[int] = None
    batch_size: int = 8


def require(key: str) -> None:
    """lm-eval importable, or the install command said by key."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(Problem(key, "the benchmark tasks need lm-evaluation-harness, which is not installed",
                                fix=INSTALL)) from None


def is_task_file(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


def task_specs(tasks: list[str], key: str) -> list[Union[str, dict]]:
    """Each task as lm-eval's own command line hands it over: a registry name as it is, a YAML
    file as its config (lm-eval's loader: `include:` and `!function` resolved beside the file)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    specs: list[Union[str, dict]] = []
    for task in tasks:
        if not is_task_file(task):
            specs.append(task)
            continue
        path = Path(task).expanduser()
        if not path.is_file():
            raise UserError(Problem(key, f"{task}: no such task file", fix="give a path to an lm-eval task YAML, "
                                    "or a task name of its registry (lm-eval ls tasks)"))
        try:
            specs.append(load_yaml(str(path.resolve()), resolve_func=True))
        except Exception as error:  # the loader raises yaml's and its own errors alike
            raise UserError(Problem(key, f"{task}: not an lm-eval task file ({error})",
                                    fix="see lm-eval's docs/new_task_guide.md for the fields")) from None
    return specs


def task_manager(specs: list[Union[str, dict]], key: str) -> Any:
    """lm-eval's TaskManager; its built-in registry is indexed only when a task is named from it
    (indexing it reads every task YAML it ships, seconds)."""
    names = [s for s in specs if isinstance(s, str)]
    manager = _task_manager(bool(names))
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=1)
        raise UserError(Problem(key, f"{unknown[0]!r} is no task of lm-evaluation-harness"
                                + (f" (did you mean {close[0]!r}?)" if close else ""),
                                fix="list the tasks with `lm-eval ls tasks`, or give a task YAML file"))
    return manager


@functools.lru_cache(maxsize=2)
def _task_manager(include_defaults: bool) -> Any:
    """One per process: a run's evaluations reuse the index rather than read the registry again."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=include_defaults)


def check_tasks(tasks: list[str], key: str) -> None:
    """lm-eval installed, every task file readable, every name in its registry, and the data each
    task reads there to be read (a local file present; a hub data set cached or the hub
    reachable): refused by key, before a run writes anything or a model is loaded."""
    require(key)
    specs = task_specs(tasks, key)
    from overdrive.hf.task_data import check_task_data

    check_task_data(specs, task_manager(specs, key), key)


def run_tasks(model: Any, tokenizer: Any, tasks: list[str], settings: TaskSettings, *, key: str = "eval.tasks",
              log: Optional[Path] = None) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of `model` on `tasks` (lm-eval's results, numbers only); with
    `log`, what lm-eval prints (its progress bars and warnings) goes to that file instead."""
    require(key)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    specs = task_specs(tasks, key)
    manager = task_manager(specs, key)
    from overdrive import hub

    # Without a network, lm-eval's data sets are read from the cache at once rather than after retries.
    with _output_to(log), hub.cache_only_when_unreachable():
        # An instance of the model: HFLM evaluates it as it is (device, dtype, adapter applied).
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
        limit = settings.limit
        limit = int(limit) if limit is not None and limit >= 1 else limit  # a count, or a fraction below 1
        results = simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit,
                                  num_fewshot=settings.num_fewshot, log_samples=False)
    return numbers(results["results"] if results else {})


def numbers(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's `results` as {task: {metric: value}}: `acc,none` is `acc`, a filter other than
    `none` is kept after an underscore (`exact_match_strict-match`); texts and N/A are left out."""
    table: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        row = {}
        for name, value in values.items():
            if "," not in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, kept_by = name.partition(",")
            if math.isfinite(value):
                row[metric if kept_by == "none" else f"{metric}_{kept_by}"] = float(value)
        if row:
            table[task] = row
    return table


def as_metrics(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """{`eval/<task>/<metric>`: value}: the fields a run writes to metrics.jsonl."""
    return {f"{BENCHMARK_PREFIX}{task}/{metric}": value for task, row in table.items() for metric, value in row.items()}


@contextmanager
def _output_to(log: Optional[Path]) -> Iterator[None]:
    """The process's stdout and stderr (file descriptors: lm-eval's progress bars, its logging and
    the `git` it runs for its report) sent to `log` while the tasks run."""
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "a") as target:
        os.dup2(target.fileno(), 1)
        os.dup2(target.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def evaluate_saved(target: str, tasks: list[str], settings: TaskSettings, *, device: Optional[str] = None,
                   dtype: str = "float32", base: Optional[str] = None, log: Optional[Path] = None
                   ) -> tuple[str, dict[str, dict[str, float]]]:
    """`overdrive eval`: (what was evaluated, {task: {metric: value}}) of a run's model, a saved
    model, or an adapter on its base (hf/saved_model.py), as a run's evaluations score it."""
    from overdrive.hf.saved_model import KEY, load

    check_tasks(tasks, "--tasks")  # a bad task refused before any weights are read
    loaded = load(target, dtype=dtype, device=device or default_device(), base=base, key=KEY)
    return loaded.what, run_tasks(loaded.model, loaded.tokenizer, tasks, settings, key="--tasks", log=log)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
