"""docs/config.md, generated from the schema: every key, its type, default and meaning."""

from __future__ import annotations

import json
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from overdrive.config.keys import ALIASES
from overdrive.config.schema import RunConfig

HEADER = """# Configuration reference

Generated from `src/overdrive/config/schema.py` by `overdrive docs`; do not edit by hand.

Every key can be set in a config file (nested sections or dotted keys), in the environment
as `OVERDRIVE_<SECTION>__<KEY>` (e.g. `OVERDRIVE_OPTIM__LR=3e-4`), on the command line as
`key=value`, or in `load_config(..., overrides={...})`. Layers, lowest to highest: schema
defaults, Accelerate's `default_config.yaml`, config files in order, environment, command
line, overrides. `overdrive explain --key KEY` shows which layer set a value.

What is refused rather than guessed: a key written twice in one mapping (both lines are
named), an empty or comments-only file, bytes that are not UTF-8 (file and byte offset),
nesting deeper than 32 levels or YAML aliases expanding past 100,000 values, `true`/`false`
for a number, `inf`/`nan` for any float, and a seed outside 0 .. 2**32-1 (numpy's range).
A whole mapping (`model.architecture`, `parallel.deepspeed.extra`) given on the command line
or in the environment is read as YAML/JSON flow syntax and merged key by key over the
lower layers, as the same block in a file is: `model.architecture={"n_layer": 2}` changes
`n_layer` and keeps the rest (a different `model_type` starts the architecture afresh).
Anything but a mapping there is an error.

Secrets (values of keys named like `hub_token` or `api_key`, hub tokens `hf_...`, API keys
`sk-...`, `user:password@` in URLs) are shown and written as `***`: in `explain`, messages,
resolved.json, checkpoints, reports and exported files. Launched workers get them through
their environment (`OVERDRIVE_SECRET_VALUES`), never from a file.
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is None:
        return getattr(annotation, "__name__", str(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    name = getattr(origin, "__name__", str(origin)).replace("Annotated", "")
    if name == "Literal":
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if name in ("Union", "UnionType"):
        text = " \\| ".join(_type_name(a) for a in args)
        return text + (" \\| null" if type(None) in get_args(annotation) else "")
    if name == "":  # Annotated[int, ...]
        return _type_name(get_args(annotation)[0])
    return f"{name}[{', '.join(_type_name(a) for a in args)}]"


def _default(info) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value, default=str)}`"


def render() -> str:
    lines = [HEADER]

    def section(model: type[BaseModel], prefix: str, title: str) -> None:
        leaves, subsections = [], []
        for name, info in model.model_fields.items():
            key = f"{prefix}{name}"
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                subsections.append((annotation, key + ".", key))
            else:
                leaves.append((key, _type_name(annotation), _default(info), info.description or ""))
        if leaves:
            lines.append(f"\n## `{title}`\n")
            if model.__doc__:
                lines.append(" ".join(model.__doc__.split()) + "\n")
            lines.append("| key | type | default | meaning |")
            lines.append("| --- | --- | --- | --- |")
            for key, type_name, default, description in leaves:
                lines.append(f"| `{key}` | {type_name} | {default} | {description} |")
        for sub_model, sub_prefix, sub_title in subsections:
            section(sub_model, sub_prefix, sub_title)

    section(RunConfig, "", "(top level)")
    lines.append("\n## Short names on the command line\n")
    lines.append("| alias | key |")
    lines.append("| --- | --- |")
    lines += [f"| `{alias}` | `{key}` |" for alias, key in ALIASES.items()]
    return "\n".join(lines) + "\n"
