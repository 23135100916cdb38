"""The ways a row holds a conversation (`data.layout`), each read into OpenAI-style turns.

    messages            a list of {role, content} turns (OpenAI's chat format; assistant turns may carry
                        `tool_calls`, `tool` turns answer them), `data.messages_column`
    prompt-completion   two columns, a string or a list of turns each (TRL's prompt/completion)
    sharegpt            `conversations`: {from, value} turns, from = human | gpt | system | function_call |
                        observation | tool (the ShareGPT dump's, as Axolotl and LLaMA-Factory read it)
    alpaca              instruction, input, output, with optional system and history ([[query, answer], ...]);
                        the instruction and input are one user turn, joined by a newline (as LLaMA-Factory does)

`auto` recognises the layout by the columns, in the order above. A `tools` column (a list of
tool descriptions, or their JSON text) and a `system` column are read in every layout; the
tools are handed to the chat template, which renders them as the model was trained to see them.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from overdrive.data import row_checks
from overdrive.errors import Problem, UserError

SHAREGPT_COLUMN = "conversations"
ALPACA_COLUMNS = ("instruction", "output")
# ShareGPT speakers -> OpenAI roles. `function_call` is an assistant turn calling a tool; its value
# is the call as JSON ({"name", "arguments"}), as in LLaMA-Factory's sharegpt data.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
                  "ipython": "tool"}
_PASSED = ("tool_calls", "tool_call_id", "name")  # turn keys the chat templates read beside role and content
# The roles a turn may have: a template renders an unknown one as whatever it makes of it (and the
# prefix rule could train it as an answer), so a row with another is refused by key.
ROLES = ("system", "user", "assistant", "tool", "developer")


def recognise(names: list[str], d) -> tuple[str, tuple[str, ...]]:
    """(layout, the columns it reads) for `data.layout` over a table with these column names."""
    wanted = d.layout
    found = {
        "messages": (d.messages_column,) if d.messages_column in names else None,
        "prompt-completion": (d.prompt_column, d.completion_column)
        if d.prompt_column in names and d.completion_column in names else None,
        "sharegpt": (_sharegpt_column(d, names),) if _sharegpt_column(d, names) in names else None,
        "alpaca": _alpaca_columns(d, names),
    }
    if wanted != "auto":
        if found[wanted] is None:
            raise UserError(Problem("data.layout", f"{wanted}: the data has no {_needs(wanted, d)} column "
                                    f"(its columns: {names})", fix="point the layout's column keys at the data's "
                                    "columns, or set data.layout to the data's layout (`auto` recognises it)"))
        return wanted, found[wanted]
    for layout, columns in found.items():
        if columns is not None:
            return layout, columns
    raise UserError(Problem("data.messages_column", f"no column {d.messages_column!r}, no {d.prompt_column!r} + "
                            f"{d.completion_column!r} pair, no ShareGPT `conversations`, no Alpaca instruction + "
                            f"output; the data has {names}",
                            fix="set data.messages_column (or data.prompt_column and data.completion_column, or "
                            "data.layout) to match the data's columns"))


def _sharegpt_column(d, names: list[str]) -> str:
    # A messages column named otherwise (`data.messages_column`) holding {from, value} turns is sharegpt too.
    return d.messages_column if d.layout == "sharegpt" and d.messages_column in names else SHAREGPT_COLUMN


def _alpaca_columns(d, names: list[str]) -> Optional[tuple[str, ...]]:
    instruction = d.prompt_column if d.prompt_column in names else "instruction"
    output = d.completion_column if d.completion_column in names else "output"
    if instruction not in names or output not in names:
        return None
    return (instruction, output) + tuple(c for c in (d.input_column, "history") if c in names)


def _needs(layout: str, d) -> str:
    return {"messages": repr(d.messages_column), "prompt-completion": f"{d.prompt_column!r} + {d.completion_column!r}",
            "sharegpt": repr(SHAREGPT_COLUMN), "alpaca": "instruction + output"}[layout]


def extra_columns(names: list[str], d) -> tuple[str, ...]:
    """The system and tools columns a row may also have."""
    return tuple(c for c in (d.system_column, d.tools_column) if c in names)


# ---------------------------------------------------------------- one row


def turns_of(layout: str, columns: tuple[str, ...], row: dict, index: int, d) -> list[dict]:
    if layout == "messages":
        turns = checked(row[columns[0]], index, "data.messages_column")
    elif layout == "prompt-completion":
        answer = _as_turns(row[columns[1]], "assistant", index, "data.completion_column")
        turns = (_as_turns(row[columns[0]], "user", index, "data.prompt_column")
                 + row_checks.answer(answer, index, "data.completion_column"))
    elif layout == "sharegpt":
        turns = sharegpt_turns(row[columns[0]], index)
    else:
        turns = alpaca_turns(row, columns, index, d)
    system = row.get(d.system_column)
    if system and not any(t["role"] == "system" for t in turns):
        turns = [{"role": "system", "content": str(system)}] + turns
    return turns


def tools_of(row: dict, index: int, d) -> Optional[list]:
    tools = row.get(d.tools_column)
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise UserError(Problem("data.tools_column", f"row {index}: not a JSON list of tools: {tools[:80]}",
                                    fix="write the tools as a JSON list of {type, function} descriptions")) from None
    return row_checks.tools(tools if isinstance(tools, list) else [tools], index)


def checked(turns: Any, row: int, key: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise UserError(Problem(key, f"row {row}: expected a list of {{role, content}} turns, got "
                                f"{type(turns).__name__}", fix="fix the row, or point the key at the right column"))
    out = []
    for turn in turns:
        if isinstance(turn, dict) and "from" in turn and "value" in turn and "role" not in turn:
            raise UserError(Problem(key, f"row {row}: a ShareGPT turn ({{from, value}}) in a messages column",
                                    fix="set data.layout=sharegpt"))
        calls = isinstance(turn, dict) and turn.get("tool_calls")
        if not isinstance(turn, dict) or "role" not in turn or ("content" not in turn and not calls):
            raise UserError(Problem(key, f"row {row}: a turn without `role` and `content`: {str(turn)[:80]}",
                                    fix="every turn needs a role and a content (or an assistant's tool_calls)"))
        role = turn["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise UserError(Problem(key, f"row {row}: a turn with role {str(role)[:40]!r}",
                                    fix=f"use one of {', '.join(ROLES)}"))
        if turn.get("tool_calls") is not None:
            row_checks.tool_calls(turn["tool_calls"], row, key)
        kept = {"role": role, "content": _content(turn.get("content"), row, key)}
        kept.update({k: turn[k] for k in _PASSED if turn.get(k) is not None})
        out.append(kept)
    return out


def _content(value: Any, row: int, key: str) -> Any:
    """Text, or a list of text parts ({"type": "text", "text": ...}, as chat APIs write them): mapping
    content would be rendered, and trained, as its printed dict."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                       and isinstance(part.get("text"), str) for part in value):
        return value
    raise UserError(Problem(key, f"row {row}: a turn's content is a {type(value).__name__}, not text: "
                            f"{str(value)[:80]}", fix="give each turn's content as a string (or a list of "
                            "{\"type\": \"text\", \"text\": ...} parts)"))


def _as_turns(value: Any, role: str, row: int, key: str) -> list[dict]:
    """A prompt or completion cell as turns: a string is one turn of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return checked(value, row, key)


def sharegpt_turns(turns: Any, row: int) -> list[dict]:
    key = "data.layout"
    if not isinstance(turns, list) or not turns:
        raise UserError(Problem(key, f"row {row}: expected a list of {{from, value}} turns (ShareGPT), got "
                                f"{type(turns).__name__}", fix="fix the row, or set data.layout to the data's layout"))
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise UserError(Problem(key, f"row {row}: a ShareGPT turn without `from` and `value`: {str(turn)[:80]}",
                                    fix="every turn needs a speaker (`from`) and a `value`"))
        speaker = str(turn["from"]).lower()
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            raise UserError(Problem(key, f"row {row}: unknown ShareGPT speaker {turn['from']!r}",
                                    fix=f"one of: {', '.join(SHAREGPT_ROLES)}"))
        value = "" if turn["value"] is None else str(turn["value"])
        if speaker == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": _calls(value, row)})
        else:
            out.append({"role": role, "content": value})
    return out


def _calls(value: str, row: int) -> list[dict]:
    try:
        calls = json.loads(value)
    except ValueError:
        raise UserError(Problem("data.layout", f"row {row}: a function_call turn whose value is not JSON: {value[:80]}",
                                fix='write the call as {"name": ..., "arguments": {...}}')) from None
    calls = calls if isinstance(calls, list) else [calls]
    for call in calls:  # a call that is no mapping, or names no function: refused, never dropped
        row_checks.tool_calls([call], row, "data.layout")
    return [{"type": "function", "function": {"name": c.get("name"), "arguments": c.get("arguments", {})}}
            for c in calls]


def alpaca_turns(row: dict, columns: tuple[str, ...], index: int, d) -> list[dict]:
    instruction, output = row[columns[0]], row[columns[1]]
    extra = row.get(d.input_column) if d.input_column in columns else None
    prompt = "\n".join(str(part) for part in (instruction, extra) if part)
    if not prompt or output is None:
        raise UserError(Problem("data.layout", f"row {index}: an Alpaca row without an instruction or an output",
                                fix="every row needs `instruction` and `output` (`input` may be empty)"))
    turns = []
    for pair in row.get("history") or []:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise UserError(Problem("data.layout", f"row {index}: history holds [query, answer] pairs, got {pair!r:.80}",
                                    fix="write history as a list of [query, answer] pairs"))
        turns += [{"role": "user", "content": str(pair[0])}, {"role": "assistant", "content": str(pair[1])}]
    return turns + [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(output)}]
