"""The reward functions of an RL run (`rl.reward_funcs`): the built-ins and users' callables, all
with TRL's signature `(prompts, completions, completion_ids, **columns) -> list[float | None]`.

A completion is text for text prompts and `[{"role": "assistant", "content": text}]` for chat
prompts, as TRL hands it; the built-ins read either. None (the function does not apply to that
row) becomes NaN, left out of the means as TRL leaves it out.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from overdrive.config.schema_rl import BUILTIN_REWARDS, RewardFunc
from overdrive.errors import Problem, UserError


def completion_text(completion: Any) -> str:
    """The text of a completion, whether plain or a list of chat turns: the policy's own (assistant) turns,
    not the tools' results between them (rl.tools)."""
    if isinstance(completion, list):
        return "".join(str(turn.get("content", "")) for turn in completion
                       if isinstance(turn, dict) and turn.get("role", "assistant") == "assistant")
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


# The arguments every call names itself; each other column of the data is handed by its name, one value
# per completion (TRL's `**kwargs`).
HANDED = ("prompt", "completion", "completion_ids")


def columns_of(rows: list[dict]) -> dict[str, list]:
    """The columns a reward function gets as keyword arguments, one value per completion's row."""
    return {k: [row.get(k) for row in rows] for k in dict.fromkeys(k for row in rows for k in row) if k not in HANDED}


@dataclass
class Reward:
    name: str
    weight: float
    function: Callable[..., list]


@contextlib.contextmanager
def importable_from(directories: Sequence[Path]) -> Iterator[None]:
    """Reward modules found beside the config files and in the working directory, as `python script.py` finds
    a module beside the script: the `overdrive` command's own sys.path has neither."""
    added = [str(d) for d in dict.fromkeys(Path(d).resolve() for d in directories) if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)


def _imported(path: str, key: str) -> Callable[..., list]:
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name:
        raise UserError(Problem(key, f"{path!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an "
                                "import path", fix="write `package.module:function` (or `package.module.function`)"))
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise UserError(Problem(key, f"cannot import {path!r}: {error}",
                                fix="put the module beside the config file or in the working directory (or on "
                                "PYTHONPATH), and check the function's name")) from None
    except Exception as error:  # the user's module itself fails as it is imported
        raise UserError(Problem(key, f"importing {module_name!r} failed: {type(error).__name__}: {error}",
                                fix="fix the module (python -c 'import " + module_name + "' shows the traceback)")) from None
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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refusal(reward: Reward, rows: Sequence[int], what: str, fix: str) -> UserError:
    rows = sorted(set(rows))
    where = f"data.source row{'s' if len(rows) > 1 else ''} {', '.join(str(r + 1) for r in rows[:8])}" if rows else ""
    return UserError(Problem("rl.reward_funcs", f"the reward {reward.name!r} {what}", where, fix),
                     title="a reward function failed while training")


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], rows: Sequence[int] | None = None) -> list[list[float]]:
    """[completion][function] rewards, None as NaN (does not apply). What a user's function raises or answers
    wrongly (the wrong count, text, NaN or inf) is refused naming the reward and the prompt's row (0-based
    `rows`, data order): a NaN would train with a loss of 0 and no word, text would fail deep in torch."""
    table = [[math.nan] * len(rewards) for _ in completions]
    rows = list(rows or [])
    for j, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                     **columns)
            values = list(values)
        except UserError:
            raise
        except Exception as error:
            raise _refusal(reward, rows, f"raised {type(error).__name__}: {error}",
                           "fix the function (it is called with TRL's arguments: prompts, completions, "
                           "completion_ids and the data's other columns)") from None
        if len(values) != len(completions):
            raise _refusal(reward, rows, f"returned {len(values)} rewards for {len(completions)} completions",
                           "return one reward per completion")
        for i, value in enumerate(values):
            row = rows[i:i + 1]
            if value is None:
                continue
            if not _is_number(value):
                raise _refusal(reward, row, f"returned {_shown(value)} ({type(value).__name__}) for completion "
                               f"{i + 1}: a reward is a number, or None where it does not apply",
                               "return floats (None for rows the reward does not judge)")
            number = float(value)
            if not math.isfinite(number):
                raise _refusal(reward, row, f"returned {number} for completion {i + 1}: a non-finite reward has "
                               "no advantage to train on", "return a finite number, or None where it does not apply")
            table[i][j] = number
    return table


def _is_number(value: Any) -> bool:
    """A scalar that float() reads as a number: numpy's and torch's one-element values too."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes))
