"""Every row of a prompt set (`data.format: prompts`) and of KTO's unpaired rows checked before a
model loads, each kind of fault one problem naming its rows and the file.

Unchecked, a row without its prompt, an empty prompt or an empty chat turn reaches the tokenizer or
the reward functions mid-run as a KeyError or a chat template's error, after the weights loaded; a
KTO set whose rows are all desirable (or all undesirable) trains with no contrast to learn from.
"""

from __future__ import annotations

from typing import Any, Callable

from overdrive.config.schema import RunConfig
from overdrive.data.row_table import RowTable
from overdrive.errors import Problem, UserError

SHOWN = 5  # rows named in a problem; the rest are counted
# TRL's KTOTrainer: desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in [1, 4/3].
KTO_RATIO = (1.0, 4 / 3)


def _rows_problem(key: str, table: RowTable, found: list[int], what: str, fix: str) -> Problem:
    """One problem for every row of one fault: its count, the first rows by number, the first's place."""
    numbers = ", ".join(str(i + 1) for i in found[:SHOWN]) + (f" and {len(found) - SHOWN} more"
                                                               if len(found) > SHOWN else "")
    rows = f"row {numbers}" if len(found) == 1 else f"{len(found)} rows ({numbers})"
    return Problem(key, f"{rows} of {table.name}: {what}", table.place(found[0]), fix)


def _turn_fault(turn: Any) -> str:
    """What is wrong with one chat turn of a prompt ('' when nothing)."""
    if not isinstance(turn, dict):
        return f"a turn is a {type(turn).__name__}, not {{role, content}}"
    if not isinstance(turn.get("role"), str) or not turn["role"].strip():
        return "a turn has no role"
    content = turn.get("content")
    if turn.get("tool_calls"):  # an assistant turn that only calls a tool says nothing of its own
        return ""
    if content is None or (isinstance(content, (str, list)) and not (content.strip() if isinstance(content, str)
                                                                     else content)):
        return f"a {turn['role']} turn is empty"
    return ""


def prompt_problems(cfg: RunConfig, table: RowTable) -> list[Problem]:
    """A prompt in every row, text or chat turns (not both kinds in one set), none empty; and the column of
    every `exact_match` reward in every row."""
    column = cfg.data.prompt_column
    if not table.rows:
        return [Problem("data.source", f"{table.name} has no rows", table.name,
                        "give a prompt set with at least one row")]
    faults: dict[str, list[int]] = {}
    kinds: dict[bool, int] = {}

    def fault(what: str, index: int) -> None:
        faults.setdefault(what, []).append(index)

    for index, row in enumerate(table.rows):
        if column not in row or row[column] is None:
            fault(f"no {column!r} column (the columns: {sorted(row)})", index)
            continue
        prompt = row[column]
        if isinstance(prompt, str):
            if not prompt.strip():
                fault("the prompt is empty", index)
            kinds.setdefault(False, index)
        elif isinstance(prompt, list):
            found = next((f for f in map(_turn_fault, prompt) if f), "") if prompt else "the prompt has no turns"
            if found:
                fault(found, index)
            kinds.setdefault(True, index)
        else:
            fault(f"the prompt is a {type(prompt).__name__}, not text or a list of turns", index)
    problems = [_rows_problem("data.prompt_column", table, rows, what, "give every row a prompt: text, or "
                              "[{role: user, content: ...}] turns with something in each")
                for what, rows in faults.items()]
    problems += _pictured_for_text(cfg, table)
    if len(kinds) == 2:
        problems.append(Problem("data.prompt_column", f"{table.name} mixes text prompts (row {kinds[False] + 1}) and "
                                f"chat turns (row {kinds[True] + 1}): a prompt set is one or the other",
                                table.place(kinds[True]), "write every prompt the same way"))
    for index, spec in enumerate(cfg.rl.reward_funcs):
        if spec.function == "exact_match":
            lacking = [i for i, row in enumerate(table.rows) if row.get(spec.column) is None]
            if lacking:
                problems.append(_rows_problem(f"rl.reward_funcs[{index}].column", table, lacking,
                                              f"no {spec.column!r} value, which the exact_match reward compares "
                                              f"each completion with (the columns: {table.columns})",
                                              "set the reward's column to the one holding the answers"))
    return problems


def _pictured_for_text(cfg: RunConfig, table: RowTable) -> list[Problem]:
    """Prompts with image parts for a model known to have no vision tower: its chat template would render the
    parts as text and the images would never be seen, silently."""
    from overdrive.hf.vision import known_text

    def pictured(prompt: Any) -> bool:
        return isinstance(prompt, list) and any(
            isinstance(turn, dict) and isinstance(turn.get("content"), list)
            and any(isinstance(part, dict) and part.get("type") in ("image", "image_url") for part in turn["content"])
            for turn in prompt)

    found = [i for i, row in enumerate(table.rows) if pictured(row.get(cfg.data.prompt_column))]
    if not found or not known_text(cfg):
        return []
    return [_rows_problem("data.prompt_column", table, found, "image parts in the prompt, and model.name_or_path "
                          "has no vision tower: the images would be dropped and the parts rendered as text",
                          "train a vision-language model (docs/vision.md), or give prompts of text alone")]


def kto_balance(cfg: RunConfig, table: RowTable,
                where: Callable[[str], str]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) on KTO's labels: every row on one side is refused (nothing to contrast it
    with); weights x counts outside TRL's recommended 1 to 4/3 is a warning naming the counts and the
    weights that would balance them."""
    from overdrive.data.preference_layouts import desirable, unpaired_columns

    pref = cfg.preference
    try:
        columns = unpaired_columns(table.columns, cfg.data)
    except UserError as error:
        return error.problems, []
    if "paired" in columns:  # each pair becomes one desirable and one undesirable row: balanced
        return [], []
    labels, bad = [], []
    for index, row in enumerate(table.rows):
        try:
            labels.append(desirable(row.get(columns["label"]), index))
        except UserError:
            bad.append(index)
    if bad:
        return [_rows_problem("data.label_column", table, bad, f"the label ({columns['label']!r}) is not true or "
                              "false", "mark each row's completion desirable (true) or undesirable (false)")], []
    good = sum(labels)
    poor = len(labels) - good
    if not good or not poor:
        side = "desirable" if good else "undesirable"
        return [Problem("data.label_column", f"all {len(labels)} rows of {table.name} are {side} (0 "
                        f"{'undesirable' if good else 'desirable'}): KTO learns from the contrast between the two, "
                        "and one side alone has none", table.name,
                        "add rows of the other label; to teach the desirable answers alone, fine-tune on them "
                        "(preference.method=none, data.format=chat)")], []
    ratio = pref.desirable_weight * good / (pref.undesirable_weight * poor)
    if KTO_RATIO[0] <= ratio <= KTO_RATIO[1]:
        return [], []
    balanced = poor / good * pref.undesirable_weight
    return [], [Problem("preference.desirable_weight", f"{good} desirable and {poor} undesirable rows in "
                        f"{table.name}: desirable_weight x {good} / (undesirable_weight x {poor}) = {ratio:.2f}, "
                        "outside the 1 to 4/3 TRL recommends", where("preference.desirable_weight"),
                        f"set preference.desirable_weight to about {balanced:.3g} (or undesirable_weight to "
                        f"about {pref.desirable_weight * good / poor:.3g})")]
