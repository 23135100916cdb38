"""The layouts preference rows come in, recognised by their columns (or named by `data.layout`),
each read into TRL's: a prompt and answers, all text or all {role, content} turns.

    trl        `prompt`, `chosen`, `rejected` (TRL's standard layout: text; its conversational one:
               turns); without a prompt column the prompt is the turns both answers share (TRL's
               implicit prompt). An answer may also be one {role, content} message or, beside a
               prompt of turns, a string (Axolotl's `chat_template.default` rows): one assistant turn.
               `data.layout: messages` or `prompt-completion` name it.
    sharegpt   a `conversations` column of {from, value} turns and `chosen` / `rejected` each one
               {from, value} message (LLaMA-Factory's ShareGPT pairs, `ranking: true`)
    alpaca     `instruction` (`data.prompt_column` when the data has it), `input`, `system`, `history`
               beside `chosen` / `rejected` text (LLaMA-Factory's Alpaca pairs): one user turn, as
               the chat layout's alpaca rows

KTO's rows (preference.method kto) hold one completion and a `label` (desirable or not):
`prompt` + `completion` (TRL's unpaired layout, text or turns), or a whole conversation in a
messages column (ShareGPT's tags or OpenAI's) whose last turn is the completion (LLaMA-Factory's
KTO rows). Paired rows are split into a desirable and an undesirable row (TRL's
`unpair_preference_dataset`).
"""

from __future__ import annotations

from typing import Any, Optional

from overdrive.data.layouts import alpaca_turns, checked, sharegpt_turns
from overdrive.errors import Problem, UserError

KEYS = {"prompt": "data.prompt_column", "chosen": "data.chosen_column", "rejected": "data.rejected_column",
        "completion": "data.completion_column", "label": "data.label_column", "messages": "data.messages_column"}
SHAREGPT = "conversations"


def recognise_pairs(names: list[str], d) -> str:
    """The layout of preference pairs with these columns: trl, sharegpt or alpaca."""
    if d.layout == "sharegpt" or (d.layout == "auto" and SHAREGPT in names and d.prompt_column not in names):
        return "sharegpt"
    if d.layout == "alpaca" or (d.layout == "auto" and "instruction" in names and d.prompt_column not in names):
        return "alpaca"
    return "trl"


def pair_columns(layout: str, names: list[str], d) -> dict[str, Optional[str]]:
    """part -> column for a layout (None: absent)."""
    columns: dict[str, Optional[str]] = {"chosen": d.chosen_column, "rejected": d.rejected_column}
    if layout == "sharegpt":
        column = d.messages_column if d.messages_column in names else SHAREGPT
        _needs(column, names, "data.messages_column", "ShareGPT pairs keep the prompt's turns in `conversations`")
        columns["prompt"] = column
    elif layout == "alpaca":
        column = d.prompt_column if d.prompt_column in names else "instruction"
        _needs(column, names, "data.prompt_column", "Alpaca pairs keep the prompt in `instruction`")
        columns["prompt"] = column
        for extra in (d.input_column, "history"):
            columns[extra] = extra if extra in names else None
    else:
        columns["prompt"] = d.prompt_column if d.prompt_column in names else None
    columns[d.system_column] = d.system_column if d.system_column in names and layout != "trl" else None
    return columns


def _needs(column: str, names: list[str], key: str, why: str) -> None:
    if column not in names:
        raise UserError(Problem(key, f"no column {column!r} ({why}); the data has {names}",
                                fix=f"set {key} to the column that holds it, or data.layout to the data's layout"))


def _where(index: int) -> str:
    return f"row {index + 1} (line {index + 1} of a jsonl file)"  # counted from 1, as an editor counts lines


def answer_turns(value: Any, index: int, key: str, sharegpt: bool = False) -> list[dict]:
    """An answer as turns: a list of turns, one message ({role, content} or {from, value}), or text."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and isinstance(value[0], dict) and "from" in value[0]:
        return sharegpt_turns(value, index)
    if sharegpt and not isinstance(value, list):
        raise UserError(Problem(key, f"{_where(index)}: expected a {{from, value}} message, got "
                                f"{type(value).__name__}", fix="fix the row, or set data.layout to the data's layout"))
    return checked(value, index, key)


def pair_of(layout: str, columns: dict[str, Optional[str]], row: dict, index: int, d) -> dict[str, Any]:
    """One row as {prompt, chosen, rejected} in TRL's layout (text throughout, or turns throughout)."""
    for part in ("chosen", "rejected"):
        value = row[columns[part]]
        if value is None or value == "" or value == []:
            raise UserError(Problem(KEYS[part], f"{_where(index)}: an empty {part!r} cell", fix="drop or fix the row"))
    if layout == "sharegpt":
        prompt = sharegpt_turns(row[columns["prompt"]], index)
        cells = {"prompt": prompt, **{p: answer_turns(row[columns[p]], index, KEYS[p], True) for p in ("chosen", "rejected")}}
    elif layout == "alpaca":
        fields = {"instruction": row[columns["prompt"]], "output": "-",
                  **{k: row[c] for k, c in columns.items() if c and k not in ("prompt", "chosen", "rejected")}}
        names = ("instruction", "output") + tuple(k for k in (d.input_column, "history") if columns.get(k))
        prompt = alpaca_turns(fields, names, index, d)[:-1]  # the instruction (and input) as the user's turn
        cells = {"prompt": prompt, **{p: answer_turns(_last_text(row[columns[p]]), index, KEYS[p]) for p in
                                      ("chosen", "rejected")}}
    else:
        return _trl_pair(columns, row, index)
    system = columns.get(d.system_column) and row.get(columns[d.system_column])
    if system and not any(t["role"] == "system" for t in cells["prompt"]):
        cells["prompt"] = [{"role": "system", "content": str(system)}] + cells["prompt"]
    return cells


def _empty(value: Any) -> bool:
    """Text with nothing in it, no turns, or turns with nothing in any of them."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        return all(map(_empty_turn, value))  # no turns at all: empty too
    return False


def _empty_turn(turn: Any) -> bool:
    if not isinstance(turn, dict):
        return _empty(turn)
    if turn.get("tool_calls"):
        return False
    content = turn.get("content", turn.get("value"))
    if isinstance(content, list):  # content parts: text, or an image
        return not any(isinstance(part, dict) and (part.get("type") == "image" or str(part.get("text") or "").strip())
                       for part in content)
    return _empty(content)


def _last_text(value: Any) -> Any:
    """An Alpaca answer given as turns or a message: its last turn's text (Axolotl's `*.ultra` rows)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1]
    if isinstance(value, dict):
        return value.get("content", value.get("value"))
    return value


def _trl_pair(columns: dict[str, Optional[str]], row: dict, index: int) -> dict[str, Any]:
    cells = {part: row[column] for part, column in columns.items() if column and part in ("prompt", "chosen", "rejected")}
    for part, value in cells.items():
        if value is None or not isinstance(value, (str, list, dict)):
            raise UserError(Problem(KEYS[part], f"{_where(index)}: {part} is a {type(value).__name__}; expected text or "
                                    "a list of {role, content} turns", fix="fix the row, or point the key at the right "
                                    "column"))
    turns = any(isinstance(v, (list, dict)) for v in cells.values())
    if turns:  # a string answer beside a prompt of turns is one assistant turn
        for part in ("chosen", "rejected"):
            cells[part] = answer_turns(cells[part], index, KEYS[part])
        if "prompt" in cells:
            prompt = cells["prompt"]
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            cells["prompt"] = checked(prompt, index, KEYS["prompt"]) if prompt else []
    if "prompt" not in cells:
        if not turns:
            raise UserError(Problem("data.prompt_column", f"no column {columns.get('prompt')!r}, and text answers "
                                    "carry no prompt of their own", fix="set data.prompt_column to the prompt"))
        n = _shared_prefix(cells["chosen"], cells["rejected"])
        cells = {"prompt": cells["chosen"][:n], "chosen": cells["chosen"][n:], "rejected": cells["rejected"][n:]}
    return cells


def _shared_prefix(chosen: list, rejected: list) -> int:
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


# ---------------------------------------------------------------- KTO's unpaired rows


def desirable(value: Any, index: int) -> bool:
    """A KTO label: true/false, 1/0, or their text."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise UserError(Problem("data.label_column", f"{_where(index)}: label {value!r} is not true or false",
                            fix="mark each row's completion desirable (true) or undesirable (false)"))


def unpaired_columns(names: list[str], d) -> dict[str, Optional[str]]:
    """KTO's rows: paired (chosen/rejected, split), prompt + completion, or a conversation's last turn."""
    if d.chosen_column in names and d.rejected_column in names:
        return {"paired": recognise_pairs(names, d)}
    _needs(d.label_column, names, "data.label_column", "KTO rows mark each completion desirable or not")
    if d.completion_column in names:
        return {"layout": "trl", "prompt": d.prompt_column if d.prompt_column in names else None,
                "completion": d.completion_column, "label": d.label_column}
    column = d.messages_column if d.messages_column in names else SHAREGPT if SHAREGPT in names else None
    if column is None:
        raise UserError(Problem("data.completion_column", f"no {d.completion_column!r} column and no conversation "
                                f"({d.messages_column!r}, {SHAREGPT!r}); the data has {names}",
                                fix="set data.completion_column (with data.prompt_column) or data.messages_column"))
    return {"layout": "conversation", "messages": column, "label": d.label_column}


def unpaired_of(columns: dict[str, Optional[str]], row: dict, index: int) -> dict[str, Any]:
    """One KTO row as {prompt, completion, desirable}."""
    label = desirable(row[columns["label"]], index)
    if columns["layout"] == "conversation":
        turns = answer_turns(row[columns["messages"]], index, KEYS["messages"])
        if len(turns) < 2 or turns[-1]["role"] != "assistant":
            raise UserError(Problem("data.messages_column", f"{_where(index)}: a KTO conversation ends with the "
                                    "completion, an assistant turn", fix="end each conversation with the answer judged"))
        return {"prompt": turns[:-1], "completion": turns[-1:], "desirable": label}
    completion = row[columns["completion"]]
    prompt = row[columns["prompt"]] if columns.get("prompt") else None
    if prompt is None:
        raise UserError(Problem("data.prompt_column", f"{_where(index)}: no prompt", fix="set data.prompt_column"))
    for part, value in (("prompt", prompt), ("completion", completion)):
        if _empty(value):  # nothing to judge, or nothing it answers: TRL would train on it silently
            raise UserError(Problem(KEYS[part], f"{_where(index)}: an empty {part}", fix="drop or fix the row"))
    if isinstance(completion, str) and isinstance(prompt, str):
        return {"prompt": prompt, "completion": completion, "desirable": label}
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return {"prompt": checked(prompt, index, KEYS["prompt"]),
            "completion": answer_turns(completion, index, KEYS["completion"]), "desirable": label}
