"""The reward functions of an RL run (`rl.reward_funcs`): the built-ins and users' callables, all
with TRL's signature `(prompts, completions, completion_ids, **columns) -> list[float | None]`.

A completion is text for text prompts and `[{"role": "assistant", "content": text}]` for chat
prompts, as TRL hands it; the built-ins read either. None (the function does not apply to that
row) becomes NaN, left out of the means as TRL leaves it out.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from overdrive.config.schema_rl import BUILTIN_REWARDS, RewardFunc
from overdrive.errors import Problem, UserError
from overdrive.training.build import user_code


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
# The keyword arguments every call passes itself: a data column of one of these names cannot be handed too.
CALLED_WITH = ("prompts", "completions", "completion_ids")


def colliding(columns: Sequence[str]) -> list[str]:
    """The data's columns named as an argument each reward call passes (a `completions` column): handed as
    well, the call would fail with "got multiple values for keyword argument" in every reward."""
    return [c for c in columns if c in CALLED_WITH and c not in HANDED]


def collision_problem(column: str, where: str = "") -> Problem:
    return Problem("data.source", f"the data has a column {column!r}, the name of the argument {column!r} every "
                   "reward function is called with (TRL's), so it cannot also be handed as a column", where,
                   f"rename the column (e.g. to '{column}_given') and read it by that name in the reward")


def columns_of(rows: list[dict]) -> dict[str, list]:
    """The columns a reward function gets as keyword arguments, one value per completion's row."""
    return {k: [row.get(k) for row in rows] for k in dict.fromkeys(k for row in rows for k in row) if k not in HANDED}


@dataclass
class Reward:
    name: str
    weight: float
    function: Callable[..., list]
    key: str = "rl.reward_funcs"  # the config key a refusal names: rl.reward_funcs[i].function once built


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
    function = user_code.import_attribute(path, module_name, attribute, key)
    if _is_async(function):  # its call returns a coroutine, never the rewards: refused before it is ever called
        raise UserError(Problem(key, f"{path!r} is an async function: async reward functions are not supported",
                                fix="define it with def (run any awaiting inside it, e.g. with asyncio.run)"))
    return function


def _is_async(function: Callable[..., Any]) -> bool:
    """An `async def` function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


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
        rewards.append(Reward(spec.name or getattr(function, "__name__", f"reward_{index}"), spec.weight, function,
                              key))
    return rewards


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refusal(reward: Reward, rows: Sequence[int], what: str, fix: str) -> UserError:
    rows = sorted(set(rows))
    where = f"data.source row{'s' if len(rows) > 1 else ''} {', '.join(str(r + 1) for r in rows[:8])}" if rows else ""
    return UserError(Problem(reward.key, f"the reward {reward.name!r} {what}", where, fix),
                     title="a reward function failed while training")


# The fix of a reward that raised: reward_checks.py tells it apart, a raise on its empty completion.
RAISED_FIX = ("fix the function (it is called with TRL's arguments: prompts, completions, completion_ids and the "
              "data's other columns)")
RETURN_FIX = "return a list of floats, one per completion (None where the reward does not apply)"


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], rows: Sequence[int] | None = None) -> list[list[float]]:
    """[completion][function] rewards, None as NaN (does not apply). What a user's function raises or answers
    wrongly (not a list, the wrong count, text, NaN or inf) is refused naming the reward and the prompt's row
    (0-based `rows`, data order): a NaN would train with a loss of 0 and no word, text would fail deep in torch."""
    clashes = colliding(list(columns))
    if clashes:  # every call would fail on it: the data's fault, not the first reward's
        raise UserError(collision_problem(clashes[0]), title="the data cannot be handed to the reward functions")
    table = [[math.nan] * len(rewards) for _ in completions]
    rows = list(rows or [])
    for j, reward in enumerate(rewards):
        values = _called(reward, rows, prompts=prompts, completions=completions, completion_ids=completion_ids,
                         **columns)
        if len(values) != len(completions):
            raise _refusal(reward, rows, f"returned {len(values)} rewards for {len(completions)} completions",
                           "return one reward per completion")
        for i, value in enumerate(values):
            if value is not None:
                table[i][j] = _number(reward, rows[i:i + 1], i, value)
    return table


def _called(reward: Reward, rows: list[int], **arguments: Any) -> list:
    """The function's rewards as a list: what it raises (a generator's body too) or exits with is refused."""
    try:
        return _as_list(reward, rows, reward.function(**arguments))
    except UserError:
        raise
    except BaseException as error:  # the user's code: sys.exit() too, which would end the run silently
        if isinstance(error, user_code.PASSED_THROUGH):
            raise
        raise _refusal(reward, rows, f"{user_code.what_it_did(error)} while being called",
                       RAISED_FIX if isinstance(error, Exception) else "return the rewards; never exit the "
                       "process from a reward function") from None


def _as_list(reward: Reward, rows: list[int], returned: Any) -> list:
    """The rewards a function returned: a list, tuple, generator, or 1-D numpy array or torch tensor. A dict or
    a set would iterate over its keys, text over its characters: each is refused by what it is."""
    if isinstance(returned, (list, tuple)):
        return list(returned)
    if inspect.isgenerator(returned):
        return list(returned)
    if inspect.isawaitable(returned):
        if inspect.iscoroutine(returned):
            returned.close()  # never awaited: closed, so Python warns of no un-awaited coroutine
        raise _refusal(reward, rows, "returned a coroutine (an async call's result, never awaited): async reward "
                       "functions are not supported", "define it with def and " + RETURN_FIX)
    ndim = getattr(returned, "ndim", None)
    if isinstance(ndim, int) and hasattr(returned, "tolist") and not isinstance(returned, (str, bytes)):
        if ndim == 1:  # numpy's ndarray, torch's Tensor
            return returned.tolist()
        shape = tuple(getattr(returned, "shape", ()))
        raise _refusal(reward, rows, f"returned a {ndim}-D {type(returned).__name__} of shape {shape}, not one "
                       "reward per completion", RETURN_FIX + ", or a 1-D array")
    raise _refusal(reward, rows, f"returned {_shown(returned)} ({type(returned).__name__}), not a list of rewards",
                   RETURN_FIX)


def _number(reward: Reward, row: Sequence[int], i: int, value: Any) -> float:
    """One completion's reward as a finite float, or a refusal saying what it was."""
    if not _is_number(value):
        raise _refusal(reward, row, f"returned {_shown(value)} ({type(value).__name__}) for completion "
                       f"{i + 1}: a reward is a number, or None where it does not apply",
                       "return floats (None for rows the reward does not judge)")
    number = float(value)
    if not math.isfinite(number):
        raise _refusal(reward, row, f"returned {number} for completion {i + 1}: a non-finite reward has "
                       "no advantage to train on", "return a finite number, or None where it does not apply")
    return number


def _is_number(value: Any) -> bool:
    """A scalar that float() reads as a number: numpy's and torch's one-element values too."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes))
