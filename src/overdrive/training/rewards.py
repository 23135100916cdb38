"""The reward functions of an RL run (`rl.reward_funcs`): the built-ins and users' callables, all
with TRL's signature `(prompts, completions, completion_ids, **columns) -> list[float | None]`.

A completion is text for text prompts and `[{"role": "assistant", "content": text}]` for chat
prompts, as TRL hands it; the built-ins read either. None (the function does not apply to that
row) becomes NaN, left out of the means as TRL leaves it out.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from overdrive.config.schema_rl import BUILTIN_REWARDS, RewardFunc
from overdrive.errors import Problem, UserError


def completion_text(completion: Any) -> str:
    """The text of a completion, whether plain or a list of chat turns."""
    if isinstance(completion, list):
        return "".join(str(turn.get("content", "")) for turn in completion if isinstance(turn, dict))
    return str(completion)


def exact_match(column: str) -> Callable[..., list[float]]:
    def exact_match(prompts, completions, **columns) -> list[float]:
        answers = columns[column]
        return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]

    return exact_match


def regex(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern, re.DOTALL)

    def regex(prompts, completions, **columns) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    return regex


def length(target: int) -> Callable[..., list[float]]:
    def length(prompts, completions, **columns) -> list[float]:
        return [-abs(len(completion_text(c)) - target) / target for c in completions]

    return length


@dataclass
class Reward:
    name: str
    weight: float
    function: Callable[..., list]


def _imported(path: str, key: str) -> Callable[..., list]:
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name:
        raise UserError(Problem(key, f"{path!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an "
                                "import path", fix="write `package.module:function` (or `package.module.function`)"))
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise UserError(Problem(key, f"cannot import {path!r}: {error}",
                                fix="check the module is importable here (PYTHONPATH) and the name is right")) from None
    if not callable(function):
        raise UserError(Problem(key, f"{path!r} is not callable", fix="name a function"))
    return function


def build(funcs: list[RewardFunc]) -> list[Reward]:
    """The run's rewards, each named as metrics.jsonl will name it (`rewards/<name>/mean`)."""
    rewards = []
    for index, spec in enumerate(funcs):
        key = f"rl.reward_funcs[{index}].function"
        if spec.function == "exact_match":
            function = exact_match(spec.column)
        elif spec.function == "regex":
            if spec.pattern is None:
                raise UserError(Problem(f"rl.reward_funcs[{index}].pattern", "the regex reward needs a pattern",
                                        fix="set pattern, e.g. '<answer>.*</answer>'"))
            function = regex(spec.pattern)
        elif spec.function == "length":
            function = length(spec.target_length)
        else:
            function = _imported(spec.function, key)
        rewards.append(Reward(spec.name or getattr(function, "__name__", f"reward_{index}"), spec.weight, function))
    return rewards


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> list[list[float]]:
    """[completion][function] rewards, None as NaN; a function answering the wrong count is named."""
    table = [[math.nan] * len(rewards) for _ in completions]
    for j, reward in enumerate(rewards):
        values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        values = list(values)
        if len(values) != len(completions):
            raise UserError(Problem("rl.reward_funcs", f"the reward {reward.name!r} returned {len(values)} rewards for "
                                    f"{len(completions)} completions", fix="return one reward per completion"))
        for i, value in enumerate(values):
            table[i][j] = math.nan if value is None else float(value)
    return table
