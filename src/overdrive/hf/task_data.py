"""What an lm-eval task reads, checked before anything runs: the data files a task YAML names
(`dataset_path: json` with `dataset_kwargs.data_files`), a local `dataset_path`, and a hub data set
(cached, or the hub reachable: one short probe, hub.unreachable). Without this a missing file or
an unreachable hub is found by `datasets` at the first evaluation, after a run has trained.

lm-eval's task index is read through its TaskManager's `_index` (name -> entry with the task's
YAML as loaded); where a version lacks it, nothing is checked here and the evaluation's own error
stands (a run saves its model before its closing evaluation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Union

from overdrive import hub
from overdrive.errors import Problem, UserError

# `dataset_path` values that name a datasets builder reading local files, not a data set.
FILE_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas", "xml", "webdataset"})
MAX_DEPTH = 8  # groups nest groups; a cycle stops here


def check_task_data(specs: list[Union[str, dict]], manager: Any, key: str) -> None:
    """Every task's data present or readable; the first that is not refused by `key`."""
    for spec in specs:
        for task, config in _leaf_configs(spec, manager, 0):
            problem = _data_problem(task, config, key)
            if problem:
                raise UserError(problem, title=f"the eval task {task!r} cannot read its data")


def _leaf_configs(spec: Union[str, dict], manager: Any, depth: int) -> Iterator[tuple[str, dict]]:
    """(task name, its YAML) of every task under `spec`: itself, a group's tasks, a tag's tasks."""
    if depth > MAX_DEPTH:
        return
    if isinstance(spec, dict):
        if "dataset_path" in spec:
            yield str(spec.get("task", "?")), spec
        members = spec.get("task")
        for member in members if isinstance(members, list) else []:
            yield from _leaf_configs(member, manager, depth + 1)
        return
    index = getattr(manager, "_index", None)
    if not isinstance(index, dict):
        return
    for name in manager.match_tasks([spec]) or [spec]:
        entry = index.get(name)
        config = getattr(entry, "cfg", None)
        if isinstance(config, dict):
            yield from _leaf_configs({**config, "task": config.get("task", name)}, manager, depth + 1)
        else:  # a tag: the tasks that carry it
            for member, other in index.items():
                if name in (getattr(other, "tags", None) or ()):
                    yield from _leaf_configs(member, manager, depth + 1)


def _files(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _files(v)]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in _files(v)]
    return []


def _data_problem(task: str, config: dict, key: str) -> Problem | None:
    path = config.get("dataset_path")
    if not isinstance(path, str) or not path:
        return None
    kwargs = config.get("dataset_kwargs") if isinstance(config.get("dataset_kwargs"), dict) else {}
    if path in FILE_BUILDERS:
        # datasets reads relative data files from the working directory, as lm-eval hands them over.
        missing = [f for f in _files(kwargs.get("data_files")) + _files(kwargs.get("data_dir"))
                   if "://" not in f and not any(c in f for c in "*?[") and not Path(f).expanduser().exists()]
        if missing:
            return Problem(key, f"task {task!r} reads {missing[0]}, which does not exist (its "
                           f"dataset_kwargs, from {Path.cwd()})",
                           fix="write the data file there, or correct data_files in the task's YAML")
        return _url_problem(task, [f for f in _files(kwargs.get("data_files")) if "://" in f], key)
    if hub.looks_local(path) or hub.is_local(path):
        if not hub.is_local(path):
            return Problem(key, f"task {task!r} reads {path}, which does not exist (its dataset_path)",
                           fix="check the path in the task's YAML")
        return None
    why = hub.unreachable()
    if why and not hub.dataset_cached(path):
        return Problem(key, f"task {task!r} reads the hub data set {path!r}, which is not in the local cache, "
                       f"and {why}",
                       fix=f"fill the cache on a machine with a network (`hf download --repo-type dataset {path}`) "
                       "and set HF_HUB_OFFLINE=1 here; or give a task YAML on local data files; or leave the task out")
    return None


def _url_problem(task: str, urls: list[str], key: str) -> Problem | None:
    """The first data file a task downloads (http, https) that cannot be: offline, or its host plainly
    unreachable, and not in datasets' downloads cache. Other schemes (s3://, gs://) are left to fsspec."""
    from huggingface_hub import constants

    for url in urls:
        if not url.startswith(("http://", "https://")):
            continue
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else hub.url_unreachable(url)
        if why and not _downloaded(url):
            return Problem(key, f"task {task!r} downloads {url} (its dataset_kwargs.data_files), which is not in "
                           f"datasets' downloads cache, and {why}",
                           fix="download the file and point data_files at the local copy; or leave the task out")
    return None


def _downloaded(url: str) -> bool:
    """Whether datasets has downloaded `url` before: each download's `<hash>.json` beside it names its URL."""
    import json

    from datasets import config as datasets_config

    for meta in Path(datasets_config.DOWNLOADED_DATASETS_PATH).glob("*.json"):
        try:
            if json.loads(meta.read_text()).get("url") == url:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False
