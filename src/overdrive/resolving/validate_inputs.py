"""Cross-key rules on what a run reads: the places named by keys, and a mixture's sources
against each other. Checked when the config loads, so a run is refused by key before any
file is written or any process starts."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Callable

from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# What a run replaces whole inside output_dir: an input in one of them is gone at the run's end.
REPLACED = ("model", "merged", "checkpoints")


def _output_over_inputs(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """output_dir never is, nor lies inside, a place the run reads (the base model, the adapter
    continued, a local data set), and no input lies in the folders the run replaces whole:
    the run would write over what it trains from (storage/overlap.py, every writer's rule)."""
    from pathlib import Path

    from overdrive.storage.overlap import local_input, relation

    inputs = {"model.name_or_path": cfg.model.name_or_path, "peft.adapter_path": cfg.peft.adapter_path,
              "tokenizer.name_or_path": cfg.tokenizer.name_or_path, "distill.teacher": cfg.distill.teacher,
              "data.source": cfg.data.source, "eval.prompts": cfg.eval.prompts,
              **{f"data.sources.{i}.source": entry.source for i, entry in enumerate(cfg.data.sources)}}
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


def input_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    return (_masked(cfg, where) + _cache_dir(cfg, where) + _mixture_kinds(cfg, where) + _eval_inputs(cfg, where)
            + _output_over_inputs(cfg, where))


def _masked(cfg: RunConfig, where) -> list[Problem]:
    """A value holding the mask `***` where a credential was (a file `overdrive import` or `export`
    wrote): refused by its key, rather than read as a URL or a token that fails later."""
    from overdrive.config.env_report import MASK
    from overdrive.config.keys import flatten

    def texts(value) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in texts(v)]
        if isinstance(value, dict):
            return [t for v in value.values() for t in texts(v)]
        return []

    return [Problem(key, f"holds {MASK} where a credential was masked (in a file overdrive wrote)", where(key),
                    f"give the real value where the run starts: {key}=... on the command line, or the environment "
                    "variable the library reads (HF_TOKEN for the hub)")
            for key, value in flatten(cfg.model_dump(mode="json")).items()
            if any(MASK in text for text in texts(value))]


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


def _eval_inputs(cfg: RunConfig, where) -> list[Problem]:
    """`eval.*` reads task files and a prompts file, and needs a model that writes text."""
    from overdrive.hf.benchmarks import INSTALL
    from overdrive.hf.generation import read_prompt_rows

    e = cfg.eval
    found = []
    scorer = ("model.task", cfg.model.task) if cfg.model.task != "causal-lm" else \
        ("preference.method", "reward") if cfg.preference.method == "reward" else None  # a scalar head, no text
    if (e.tasks or e.prompts) and scorer:
        found.append(Problem("eval.tasks" if e.tasks else "eval.prompts", f"benchmarks and sample answers need a "
                             f"model that writes text; {scorer[0]} is {scorer[1]}", where(scorer[0]),
                             "leave eval.tasks and eval.prompts empty for this run"))
    if e.tasks and importlib.util.find_spec("lm_eval") is None:
        found.append(Problem("eval.tasks", "the benchmark tasks need lm-evaluation-harness, which is not installed",
                             where("eval.tasks"), INSTALL))
    missing = [t for t in e.tasks if t.endswith((".yaml", ".yml")) and not os.path.isfile(os.path.expanduser(t))]
    if missing:
        found.append(Problem("eval.tasks", f"{missing[0]}: no such task file", where("eval.tasks"),
                             "give a path to an lm-eval task YAML, or a task name of its registry (lm-eval ls tasks)"))
    if e.prompts is not None:
        try:
            rows = read_prompt_rows(e.prompts)
            if not rows:
                found.append(Problem("eval.prompts", "no prompts in it", where("eval.prompts"),
                                     "give at least one prompt, or leave eval.prompts empty"))
            found += _prompt_images(cfg, rows, where)
        except ValueError as error:
            found.append(Problem("eval.prompts", str(error), where("eval.prompts"),
                                 "give a list of prompts, or a file of them (one a line, or .jsonl with `prompt`)"))
    return found


def _prompt_images(cfg: RunConfig, rows: list, where) -> list[Problem]:
    """A prompt's images (a .jsonl row's `images`) are files here, asked of a vision-language model."""
    from overdrive.resolving.composition import is_vision

    with_images = [row for row in rows if row.images]
    missing = [(row, image) for row in with_images for image in row.images if not os.path.isfile(image)]
    if missing:
        row, image = missing[0]
        return [Problem("eval.prompts", f"{row.place}: no image file {image}", where("eval.prompts"),
                        "give image paths relative to the prompts file's directory")]
    if with_images:  # a file PIL cannot identify is found now, not at the first evaluation, steps into the run
        from overdrive.hf.vision import unopened_image

        unopened = next(filter(None, (unopened_image(image, image, row.place) for row in with_images
                                      for image in row.images)), None)
        if unopened is not None:
            return [Problem("eval.prompts", unopened.message, where("eval.prompts"), unopened.fix)]
    if with_images and not is_vision(cfg):
        return [Problem("eval.prompts", f"{with_images[0].place}: a prompt with images, but "
                        f"{cfg.model.name_or_path} is not a vision-language model", where("eval.prompts"),
                        "drop the prompts' `images`, or train a vision-language model (model.vision.enabled=true for "
                        "a hub model not read yet; docs/vision.md)")]
    return []
