"""The user's reward functions checked before a model loads: each imported, its signature bound to
the arguments it will get (prompts, completions, completion_ids and every other column of the
data), then called once on an empty completion of the first row, which a policy can produce at
any step, so a function that fails on it would fail mid-run.

The trial call runs in a thread and is given `TRIAL_SECONDS`: a function that waits on a network
(a judge model behind an API) is left to the run rather than holding up `explain`.
"""

from __future__ import annotations

import inspect
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from overdrive.config.redact import is_secret_value, redact_text
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.training.objectives import rewards
from overdrive.training.build import user_code

if TYPE_CHECKING:
    from overdrive.data.row_table import RowTable

TRIAL_SECONDS = 10.0
_NAMED = ("prompts", "completions", "completion_ids")


def problems(cfg: RunConfig, table: Optional[RowTable], where: Callable[[str], str]) -> list[Problem]:
    """Every reward's problems; `table` None: the rows are not at hand (a hub data set), only the import and
    the parts of the signature that need no columns are checked."""
    found = _name_problems(cfg, where)
    clashes = rewards.colliding(table.columns) if table is not None else []
    # A column named as a call's argument fails every reward's call: said once, by the data, and no reward tried.
    found += [rewards.collision_problem(c, where("data.source")) for c in clashes]
    named: dict[str, int] = {}  # each reward's name (metrics.jsonl's rewards/<name>/*): the first reward of it
    for index, spec in enumerate(cfg.rl.reward_funcs):
        key = f"rl.reward_funcs[{index}]"
        here = where("rl.reward_funcs")
        if spec.function == "regex" and spec.pattern is None:
            found.append(Problem(f"{key}.pattern", "the regex reward needs a pattern", here,
                                 "set pattern, e.g. '<answer>.*</answer>' (quoted)"))
            continue
        try:
            built = rewards.build([spec])[0]
        except UserError as error:
            found += [Problem(f"{key}.function", p.message, here, p.fix) for p in error.problems]
            continue
        found += _same_name(built.name, index, named, here)
        if spec.function in ("exact_match", "regex", "length"):
            continue  # ours: the data's columns are checked with the rows (data/prompt_checks.py)
        if clashes:
            continue
        columns = [c for c in table.columns if c not in rewards.HANDED] if table is not None else None
        if columns is not None and cfg.rl.environment:  # every call hands the completions' environments too
            columns.append("environments")
        unbound = _unbound(built.function, columns)
        if unbound:
            wanted = re.search(r"missing a required argument: '(\w+)'", unbound)
            column = (f"give the data a {wanted.group(1)!r} column (each call hands every column by its name), or "
                      if wanted else "")  # a library's reward (TRL's accuracy_reward reads `solution`)
            found.append(Problem(f"{key}.function", f"{spec.function} {unbound}", here,
                                 f"{column}take the columns you need by name and **kwargs for the rest, as TRL's "
                                 "reward functions do: def reward(prompts, completions, answer, **kwargs)"))
            continue
        # The trial needs an environment's instances (rl.environment): its rewards are first called in the run.
        if table is not None and table.rows and not cfg.rl.environment:
            failed = _trial(cfg, built, table)
            if failed:
                found.append(Problem(f"{key}.function", failed[0], here, failed[1]))
    return found


def _same_name(name: str, index: int, named: dict[str, int], where: str) -> list[Problem]:
    """A second reward of one name: both would log as rewards/<name>/*, one hiding the other."""
    first = named.setdefault(name, index)
    if first == index:
        return []
    return [Problem(f"rl.reward_funcs[{index}].name", f"{name!r} is also the name of rl.reward_funcs[{first}]: "
                    f"metrics.jsonl would log both as rewards/{name}/mean, one hiding the other", where,
                    "give each reward a name of its own (name: ...)")]


def _name_problems(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """A reward's name shaped like a secret (a hub token, an API key): it becomes the metric names
    `rewards/<name>/mean` in metrics.jsonl and every tracker, where no mask reaches."""
    return [Problem(f"rl.reward_funcs[{index}].name", f"the name {redact_text(spec.name)!r} looks like a secret "
                    "(a token or an API key): it would be written into metrics.jsonl as rewards/<name>/mean",
                    where("rl.reward_funcs"), "name the reward by what it judges, e.g. name: correctness")
            for index, spec in enumerate(cfg.rl.reward_funcs) if spec.name and is_secret_value(spec.name)]


def _unbound(function: Callable, columns: Optional[list[str]]) -> str:
    """Why the call the loop makes cannot bind to `function`'s parameters ('' when it can)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C callable: its parameters are not known
        return ""
    if columns is None:  # the columns are not known: only TRL's three arguments are checked
        takes_rest = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
        named = [p for p in signature.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if not takes_rest and not {"prompts", "completions"} <= {p.name for p in named}:
            return f"{signature} does not take TRL's arguments (prompts, completions, completion_ids, **columns)"
        return ""
    arguments = {name: None for name in (*_NAMED, *columns)}
    try:
        signature.bind(**arguments)
    except TypeError as error:
        return (f"{signature} cannot take the arguments each call hands it ({', '.join(arguments)}): {error}")
    return ""


def _trial(cfg: RunConfig, reward: "rewards.Reward", table: RowTable) -> Optional[tuple[str, str]]:
    """The trial call on an empty completion of the first row with a prompt: what went wrong and its fix (None
    when nothing, or no answer in time)."""
    first = next((i for i, r in enumerate(table.rows) if r.get(cfg.data.prompt_column)), None)
    if first is None:  # no row has a prompt: data/prompt_checks.py says so
        return None
    row = table.rows[first]
    prompt = row.get(cfg.data.prompt_column)
    completion: Any = [{"role": "assistant", "content": ""}] if isinstance(prompt, list) else ""
    columns = {name: [row.get(name)] for name in table.columns if name not in rewards.HANDED}
    outcome: list[Optional[Problem]] = []

    def call() -> None:
        try:
            rewards.score([reward], [prompt], [completion], [[]], columns, rows=[first])
            outcome.append(None)
        except UserError as error:
            outcome.append(error.problems[0])
        except BaseException as error:  # noqa: BLE001 - a real Ctrl-C in this thread: reported, not lost
            outcome.append(Problem("", user_code.what_it_did(error), fix=rewards.RAISED_FIX))

    worker = threading.Thread(target=call, name=f"reward trial {reward.name}", daemon=True)
    worker.start()
    worker.join(TRIAL_SECONDS)
    if not outcome or outcome[0] is None:
        return None
    said = outcome[0].message.replace(f"the reward {reward.name!r} ", "", 1)
    # An exception on the empty completion is most likely its emptiness; a wrong return type or an exit is not.
    fix = _EMPTY_FIX if outcome[0].fix == rewards.RAISED_FIX else outcome[0].fix
    return f"called once on an empty completion of {table.place(first)}, it {said}", fix


_EMPTY_FIX = "a completion may be empty: return a number (or None) for any text"
