"""The tools a policy may call while it generates (`rl.tools`), as TRL's GRPOTrainer takes them:
plain Python functions with type hints and a docstring, their JSON schemas made by Transformers'
`get_json_schema` and rendered by the tokenizer's chat template; a tool call the policy writes is
read by the tokenizer's `response_template` (`tokenizer.parse_response`), the format of its own
template.

    build(paths)                 the tools, imported (refused by `rl.tools[i]`)
    problems(paths)              the same, as Problems, for `explain` (training/build/user_inputs.py)
    template_problems(tok, ...)  can this tokenizer render a tool conversation, read a tool call back,
                                 and keep a conversation's prefix when a tool message is added?
    parse(tok, ids, prefix, ..)  a completion's message: its content and tool calls (TRL's fallback:
                                 a malformed call is plain text)
    call(tool, arguments, s)     a tool's result, or its error as the result (TRL's: never fatal),
                                 with a timeout
    suffix_ids(tok, messages)    the tokens the template puts between the policy's turn and its next
                                 one around these tool messages (TRL's `_get_tool_suffix_ids`)
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from overdrive.errors import Problem, UserError
from overdrive.training.build import user_code


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict
    key: str = "rl.tools"  # the config key a refusal names: rl.tools[i] once built


def _imported(path: str, key: str) -> Callable[..., Any]:
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name:
        raise UserError(Problem(key, f"{path!r} is not an import path",
                                fix="write `package.module:function` (or `package.module.function`)"))
    return user_code.import_attribute(path, module_name, attribute, key)


def schema_of(function: Callable[..., Any], path: str, key: str) -> dict:
    """Transformers' schema of the function, as the chat template receives it: it needs a type hint on
    every argument and a docstring describing the function and each argument (Google style)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:  # TypeHintParsingException, DocstringParsingException
        raise UserError(Problem(key, f"{path!r} has no tool schema: {error}",
                                fix="give every argument a type hint and the function a docstring with an "
                                "`Args:` line per argument, as Transformers' get_json_schema reads them")) from None


def build(paths: Sequence[str]) -> list[Tool]:
    """The run's tools; a module is found beside the config files and in the working directory when the
    caller wraps this in training/rewards.importable_from."""
    tools: list[Tool] = []
    for index, path in enumerate(paths):
        key = f"rl.tools[{index}]"
        function = _imported(path, key)
        if inspect.isclass(function) or inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
            # called, it would answer the policy with an instance or an unawaited coroutine, silently
            what, fix = (("a class", "name a function (a method of an environment is rl.environment's)")
                         if inspect.isclass(function) else ("async: async tools are not supported",
                                                            "define it with def (run any awaiting inside it, "
                                                            "e.g. with asyncio.run)"))
            raise UserError(Problem(key, f"{path!r} is {what}; a tool is a plain function whose result the policy "
                                    "reads", fix=fix))
        schema = schema_of(function, path, key)
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise UserError(Problem(key, f"two tools are named {name!r}: the policy calls a tool by its name",
                                    fix="rename one of the functions"))
        tools.append(Tool(name, function, schema, key))
    return tools


def problems(paths: Sequence[str]) -> list[Problem]:
    """build's refusals, all of them, for `explain`."""
    found = []
    for index, path in enumerate(paths):
        try:
            build([path])
        except UserError as error:
            found += [Problem(f"rl.tools[{index}]", p.message, fix=p.fix) for p in error.problems]
    return found


# The pieces of a tool exchange a template must show (TRL's `supports_tool_calling` sentinels).
_NAME, _KEY, _VALUE, _CONTENT = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9"


def _exchange(name: str, arguments: dict, content: str) -> list[dict]:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": content}]


def template_problems(tokenizer: Any) -> list[Problem]:
    """Why this tokenizer cannot run a tool-calling rollout, by `rl.tools`: its chat template drops a tool
    call or a tool message (or has none), it has no response_template to read a call back, or adding a tool
    message re-renders the turns before it (the rollout appends tokens, it never re-renders)."""
    fix_template = ("use a model whose chat template renders `tools`, assistant `tool_calls` and `tool` messages, "
                    "or set one (tokenizer.chat_template), as TRL requires")
    if not getattr(tokenizer, "chat_template", None):
        return [Problem("rl.tools", "the tokenizer has no chat template to render the tools with", fix=fix_template)]
    try:
        rendered = tokenizer.apply_chat_template(_exchange(_NAME, {_KEY: _VALUE}, _CONTENT), tokenize=False)
    except Exception as error:  # jinja's TemplateError, a template indexing what a tool turn lacks
        return [Problem("rl.tools", f"the chat template cannot render a tool call and its result ({error})",
                        fix=fix_template)]
    if not all(s in rendered for s in (_NAME, _KEY, _VALUE, _CONTENT)):
        return [Problem("rl.tools", "the chat template drops a tool call or a tool message (only the tool-free "
                        "turns are rendered)", fix=fix_template)]
    if getattr(tokenizer, "response_template", None) is None:
        return [Problem("rl.tools", "the tokenizer has no response_template: the policy's tool calls cannot be "
                        "read back from its text", fix="set tokenizer.response_template (Transformers' response "
                        "parsing; TRL's chat_template_utils has them for Qwen, Llama 3, GLM and others) and save it "
                        "with the tokenizer")]
    try:
        suffix_ids(tokenizer, [{"role": "tool", "name": "dummy", "content": "dummy"}])
    except ValueError as error:
        return [Problem("rl.tools", str(error), fix="use a prefix-preserving chat template (TRL's "
                        "get_training_chat_template makes one for known models)")]
    return []


def parse(tokenizer: Any, ids: list[int], prefix: list[int], tools: Sequence[Tool]) -> dict:
    """The assistant message a completion is: its content and tool calls, read by the tokenizer's
    response_template, the arguments typed by each tool's schema. A call the template cannot read (a
    truncated or malformed one) leaves the completion plain text, as TRL's `parse_response` does."""
    try:
        parsed = tokenizer.parse_response(ids, prefix=prefix, tools=[t.schema for t in tools])
        if not isinstance(parsed, dict):
            raise ValueError("no message")
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token).strip()
        parsed["content"] = parsed.get("content") or ""
        for call in parsed.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a tool call without a name")
            if not isinstance(function.get("arguments", {}), dict):
                raise ValueError("a tool call whose arguments are not an object")
    except Exception:  # the parser's ValueError, TypeError, a regex or JSON error on what the policy wrote
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def call(tools: dict[str, Tool], tool_call: dict, timeout_s: float) -> tuple[str, Any, bool]:
    """(name, result, failed). What a tool raises, an unknown tool, a call of another type or one still
    running after `timeout_s` is answered to the policy as `{"error": ...}` (TRL's), never raised: a policy
    learns from a failed call. A call past its time keeps its thread (Python cannot stop one) as a daemon."""
    if tool_call.get("type", "function") != "function":
        return tool_call.get("name", "unknown"), {"error": f"Unsupported tool call type: {tool_call.get('type')}"}, True
    function = tool_call["function"]
    name, arguments = function["name"], function.get("arguments") or {}
    if name not in tools:
        return name, {"error": f"Tool {name} not found."}, True
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = tools[name].function(**arguments)
        except BaseException as error:  # a SystemExit here would end this thread silently, the call "answered" None
            box["error"] = error

    thread = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return name, {"error": f"Tool {name} did not answer within {timeout_s:g} s (rl.tool_timeout_s)."}, True
    if "error" in box:
        if not isinstance(box["error"], Exception):  # sys.exit() and the like: the program is broken, not the call
            raise _exited(tools[name], box["error"])
        return name, {"error": str(box["error"])}, True
    return name, box.get("result"), False


def _exited(tool: Tool, error: BaseException) -> UserError:
    """A tool that exited (or raised a BaseException, a KeyboardInterrupt too: in this thread it is never a
    real Ctrl-C): in the main thread TRL's call would have ended the run, here it is refused by the tool's key."""
    return UserError(Problem(tool.key, f"the tool {tool.name!r} {user_code.what_it_did(error)} while being called",
                             fix="return the result (or raise an exception: it is answered to the policy as an "
                             "error); never exit the process from a tool"), title="a tool failed while training")


def suffix_ids(tokenizer: Any, tool_messages: list[dict]) -> list[int]:
    """The tokens after the policy's end-of-turn up to the next generation prompt, around these tool
    messages: TRL's `_get_tool_suffix_ids` (a dummy call, rendered without and with the results)."""
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
    prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=True)
                  ["input_ids"])
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:  # the policy's turn ends at its end-of-sequence token: whatever the template adds after it is ours
        prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template renders the turns before a tool message differently once it is added "
                         "(not prefix-preserving)")
    return full[len(prefix):]
