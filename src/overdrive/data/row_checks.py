"""What a row teaches, checked before it is tokenized: answers that are the assistant's, tool
calls a chat template can render (a function with a name), tool descriptions with a name.

A chat template renders a malformed call as whatever its Jinja makes of it (a string call
becomes its characters, a call without a name an empty one) and the run trains on that with
exit 0; an answer given as a user turn is trained as if the assistant had said it. Each is
refused by the key of the column that holds it, with the row.
"""

from __future__ import annotations

import json
from typing import Any

from overdrive.errors import Problem, UserError

CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
ANSWER_ROLES = ("assistant", "tool")  # an answer may call a tool and read its result before it ends


def _name_of(item: Any) -> Any:
    """The function name of a call or a tool description: OpenAI's nested form or the flat one."""
    if not isinstance(item, dict):
        return None
    function = item.get("function")
    if isinstance(function, dict):
        return function.get("name")
    return item.get("name")


def tool_calls(calls: Any, row: int, key: str) -> list:
    """An assistant turn's tool_calls: a list of calls, each naming its function; arguments an
    object (or its JSON text)."""
    if not isinstance(calls, list):
        raise UserError(Problem(key, f"row {row}: tool_calls is a {type(calls).__name__} ({str(calls)[:60]!r}), "
                                "not a list of calls", fix=f"write each call as {CALL_SHAPE}"))
    for call in calls:
        name = _name_of(call)
        if not isinstance(name, str) or not name.strip():
            raise UserError(Problem(key, f"row {row}: a tool call without a function name: {str(call)[:80]}",
                                    fix=f"write each call as {CALL_SHAPE}"))
        arguments = (call.get("function") if isinstance(call.get("function"), dict) else call).get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise UserError(Problem(key, f"row {row}: the arguments of the call to {name!r} are not JSON: "
                                        f"{arguments[:60]}", fix="give the arguments as an object")) from None
        if not isinstance(arguments, dict):
            raise UserError(Problem(key, f"row {row}: the arguments of the call to {name!r} are a "
                                    f"{type(arguments).__name__}, not an object", fix="give the arguments as an object"))
    return calls


def tools(described: list, row: int, key: str = "data.tools_column") -> list:
    """A row's tool descriptions: each a mapping that names its function."""
    for tool in described:
        name = _name_of(tool)
        if not isinstance(name, str) or not name.strip():
            raise UserError(Problem(key, f"row {row}: a tool description without a name: {str(tool)[:80]}",
                                    fix='describe each tool as {"type": "function", "function": {"name": ..., '
                                    '"description": ..., "parameters": {...}}}'))
    return described


def answer(turns: list[dict], row: int, key: str) -> list[dict]:
    """The turns of an answer (a completion, a chosen or rejected reply): the assistant's, ending
    with an assistant turn."""
    others = [t["role"] for t in turns if t["role"] not in ANSWER_ROLES]
    if others or not turns or turns[-1]["role"] != "assistant":
        roles = [t["role"] for t in turns]
        raise UserError(Problem(key, f"row {row}: the answer's turns are {roles}: an answer is the assistant's "
                                "(it would be trained as if the assistant had said "
                                + ("the user's words)" if others else "nothing)"),
                                fix="give the answer as assistant turns (the prompt holds the user's), or point "
                                "the key at the answer's column"))
    return turns
