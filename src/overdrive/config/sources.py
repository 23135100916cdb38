"""Reading config files safely, keeping the line each value came from.

YAML goes through `yaml.SafeLoader` only: a `!!python/...` tag is an error, never executed.
JSON values come from the json module (so `2e8` is a number, as DeepSpeed reads it, where
YAML 1.1 would read a string); lines come from composing the same text as YAML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from overdrive.errors import Problem, UserError

Path_ = tuple[str, ...]


@dataclass
class LoadedFile:
    """A parsed file: its data, and the 1-based line of every key path in it."""

    path: Path
    data: dict[str, Any]
    lines: dict[Path_, int] = field(default_factory=dict)

    def line(self, *keys: str) -> int | None:
        return self.lines.get(tuple(keys))

    def where(self, *keys: str) -> str:
        line = self.line(*keys)
        return f"{self.path}:{line}" if line else str(self.path)


def _line_map(node: yaml.Node, loader: yaml.SafeLoader, prefix: Path_ = ()) -> dict[Path_, int]:
    lines: dict[Path_, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = str(key_node.value)
            path = prefix + (key,)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_line_map(value_node, loader, path))
    return lines


def _compose(text: str, path: Path) -> tuple[Any, yaml.Node | None, yaml.SafeLoader]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.constructor.ConstructorError as error:
        mark = error.problem_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(
            Problem(
                "",
                f"unsafe or unknown YAML tag: {error.problem}",
                where,
                "remove the tag; overdrive reads plain YAML values only and never runs code from a config",
            )
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(Problem("", f"not valid YAML: {getattr(error, 'problem', error)}", where)) from None
    finally:
        loader.dispose()
    return data, node, loader


def load_file(path: str | Path) -> LoadedFile:
    path = Path(path)
    if not path.is_file():
        raise UserError(Problem("", f"config file not found: {path}", fix="check the path (relative paths start from the current directory)"))
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(Problem("", f"not valid JSON: {error.msg}", f"{path}:{error.lineno}")) from None
        try:
            _, node, loader = _compose(text, path)
            lines = _line_map(node, loader) if node is not None else {}
        except UserError:
            lines = {}  # valid JSON that YAML cannot compose (tabs): values without lines
    else:
        data, node, loader = _compose(text, path)
        lines = _line_map(node, loader) if node is not None else {}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(Problem("", "a config file must hold a mapping of keys to values", str(path)))
    return LoadedFile(path=path, data=data, lines=lines)
