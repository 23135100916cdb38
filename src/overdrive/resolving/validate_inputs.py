"""Cross-key rules on what a run reads: the places named by keys, and a mixture's sources
against each other. Checked when the config loads, so a run is refused by key before any
file is written or any process starts."""

from __future__ import annotations

import os
from typing import Callable

from overdrive.errors import Problem


def input_rules(cfg, where: Callable[[str], str]) -> list[Problem]:
    return _cache_dir(cfg, where) + _mixture_kinds(cfg, where) + _output_over_inputs(cfg, where)


# What a run replaces whole inside output_dir: an input in one of them is gone at the run's end.
REPLACED = ("model", "merged", "checkpoints")


def _output_over_inputs(cfg, where) -> list[Problem]:
    """output_dir never is, nor lies inside, a place the run reads (the base model, the adapter
    continued, a local data set), and no input lies in the folders the run replaces whole:
    the run would write over what it trains from (storage/overlap.py, every writer's rule)."""
    from pathlib import Path

    from overdrive.storage.overlap import local_input, relation

    inputs = {"model.name_or_path": cfg.model.name_or_path, "peft.adapter_path": cfg.peft.adapter_path,
              "data.source": cfg.data.source}
    problems = []
    for key, value in inputs.items():
        given = local_input(value) if isinstance(value, str) else None
        if given is None:
            continue
        how = relation(cfg.output_dir, given)
        replaced = next((name for name in REPLACED if relation(Path(cfg.output_dir) / name, given)), None)
        if how in ("is", "lies inside") or replaced:
            said = f"{how} {key}" if how in ("is", "lies inside") else f"holds {key} in {replaced}/, which the run replaces"
            problems.append(Problem("output_dir", f"{cfg.output_dir} {said} ({value}): the run would write over "
                                    "what it reads", where("output_dir"), f"give a new output_dir, or move {key}"))
    return problems


def _cache_dir(cfg, where) -> list[Problem]:
    """data.cache_dir is a directory: one that names a file (or sits under one) cannot hold the caches."""
    path = os.path.expanduser(cfg.data.cache_dir)
    probe = path
    while probe and not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if probe and os.path.lexists(probe) and not os.path.isdir(probe):
        what = "is a file" if probe == path else f"is under {probe}, a file"
        return [Problem("data.cache_dir", f"{cfg.data.cache_dir} {what}: the tokenizer and token caches need a "
                        "directory", where("data.cache_dir"), "give a directory (it is created when missing)")]
    return []


def _mixture_kinds(cfg, where) -> list[Problem]:
    """The sources of a mixture are all chat or all plain: a chat conversation and a packed text
    block are different samples (a loss mask and padding, against full blocks), not one stream."""
    d = cfg.data
    if not d.sources:
        return []
    chat = [(entry.format or d.format) == "chat" for entry in d.sources]
    if all(chat) or not any(chat):
        return []
    odd = chat.index(not (d.format == "chat"))
    key = f"data.sources.{odd}.format"
    kinds = ", ".join(f"{e.name}: {'chat' if c else e.format or d.format}" for e, c in zip(d.sources, chat))
    return [Problem(key, f"mixes chat and plain sources ({kinds}): one run trains on one kind of sample",
                    where(key) or where("data.sources"),
                    "make every source chat (data.format=chat, or each entry's format), or none")]
