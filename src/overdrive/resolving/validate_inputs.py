"""Cross-key rules on what a run reads: the places named by keys, and a mixture's sources
against each other. Checked when the config loads, so a run is refused by key before any
file is written or any process starts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def input_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    return _cache_dir(cfg, where) + _mixture_kinds(cfg, where)


def _cache_dir(cfg: RunConfig, where) -> list[Problem]:
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


def _mixture_kinds(cfg: RunConfig, where) -> list[Problem]:
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
