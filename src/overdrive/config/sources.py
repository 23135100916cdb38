"""Reading config files strictly, keeping the line each value came from.

One loader for every file a user hands overdrive (run configs, Accelerate and DeepSpeed
files, Accelerate's default_config.yaml, a worker's resolved.json), and for the YAML/JSON
flow values typed on the command line or in the environment. It refuses, naming the file
and the place:

- bytes that are not UTF-8 (the byte offset, line and column),
- a key written twice in one mapping (both lines: YAML would silently keep the second),
- nesting deeper than MAX_DEPTH and aliases that expand past MAX_NODES values (a few
  lines of `&a [*b, *b, ...]` can stand for millions of values),
- an empty or comments-only file (usually a truncated or wrong file, not "all defaults"),
- YAML tags: `yaml.SafeLoader` only, a `!!python/...` tag is an error, never executed.

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
MAX_DEPTH = 32
MAX_NODES = 100_000


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


def _line_map(node: yaml.Node, prefix: Path_ = ()) -> dict[Path_, int]:
    lines: dict[Path_, int] = {}
    stack = [(node, prefix)]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = prefix + (str(key_node.value),)
                lines.setdefault(path, key_node.start_mark.line + 1)
                stack.append((value_node, path))
        elif isinstance(node, yaml.SequenceNode):  # list items by index: data.sources.0, datasets.1.path
            for index, item in enumerate(node.value):
                lines.setdefault(prefix + (str(index),), item.start_mark.line + 1)
                stack.append((item, prefix + (str(index),)))
    return lines


def _check_shape(root: yaml.Node, where: str) -> None:
    """Duplicate keys, depth and the size after alias expansion, on the composed nodes."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    # Iterative post-order walk: the nodes are shared by aliases, so each is sized once.
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        ident = id(node)
        if done:
            in_progress.discard(ident)
            children = _children(node)
            sizes[ident] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[ident] > MAX_NODES:
                raise UserError(Problem("", f"expands to more than {MAX_NODES:,} values (YAML aliases repeated "
                                            "inside each other)", where, "write the values out, or use fewer aliases"))
            continue
        if ident in sizes:
            continue
        if ident in in_progress:
            raise UserError(Problem("", "a YAML alias refers to the mapping or list that contains it", _at(where, node)))
        if depth > MAX_DEPTH:
            raise UserError(Problem("", f"nested more than {MAX_DEPTH} levels deep", _at(where, node),
                                    "a run config needs a few levels; check the brackets and indentation"))
        if isinstance(node, yaml.MappingNode):
            _check_duplicates(node, where)
        in_progress.add(ident)
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_duplicates(node: yaml.MappingNode, where: str) -> None:
    seen: dict[str, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<" and key_node.tag.endswith(":merge"):
            continue
        name = key_node.value
        line = key_node.start_mark.line + 1
        if name in seen:
            raise UserError(Problem(name, f"is written twice in one mapping (lines {seen[name]} and {line}); "
                                          "only one value can be kept", where,
                                    "remove one of them, or merge the two blocks into one"))
        seen[name] = line


def _at(where: str, node: yaml.Node) -> str:
    return f"{where}:{node.start_mark.line + 1}"


def _compose(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # refuses control characters already
        node = loader.get_single_node()
        if node is not None:
            _check_shape(node, where)
        data = loader.construct_document(node) if node is not None else None
    except yaml.constructor.ConstructorError as error:
        mark = error.problem_mark
        raise UserError(Problem(
            "", f"unsafe or unknown YAML tag: {error.problem}", f"{where}:{mark.line + 1}" if mark else where,
            "remove the tag; overdrive reads plain YAML values only and never runs code from a config")) from None
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise UserError(Problem("", f"not valid YAML: control character {error.character!r} is not allowed "
                                    f"(position {error.position}, line {line})", where,
                                "remove it; a config file is plain text")) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise UserError(Problem("", f"not valid YAML: {getattr(error, 'problem', None) or error}",
                                f"{where}:{mark.line + 1}" if mark else where)) from None
    except RecursionError:
        raise UserError(Problem("", f"nested more than {MAX_DEPTH} levels deep", where,
                                "a run config needs a few levels; check the brackets and indentation")) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, node


def decode(raw: bytes, where: str) -> str:
    """UTF-8 text, or an error naming the first byte that is not UTF-8 (offset, line, column)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        before = raw[: error.start]
        line = before.count(b"\n") + 1
        column = error.start - (before.rfind(b"\n") + 1) + 1
        raise UserError(Problem("", f"not UTF-8 text: byte 0x{raw[error.start]:02x} at offset {error.start} "
                                    f"(line {line}, column {column})", where,
                                "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")) from None
    return text.removeprefix("\ufeff")


def _json_pairs(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        mapping: dict[str, Any] = {}
        for key, value in pairs:
            if key in mapping:
                raise UserError(Problem(key, "is written twice in one JSON object; only one value can be kept",
                                        where, "remove one of them"))
            mapping[key] = value
        return mapping

    return hook


def parse_text(text: str, where: str, json_first: bool = False) -> tuple[Any, dict[Path_, int]]:
    """(data, line map) of YAML or JSON text, with every check above. `where` names the source."""
    if json_first:
        lines: dict[Path_, int] = {}
        try:  # YAML composes most JSON: duplicate keys with both lines, depth, and the line map
            _, node = _compose(text, where)
            lines = _line_map(node) if node is not None else {}
        except UserError as error:
            if all(problem.message.startswith(("not valid YAML", "unsafe")) for problem in error.problems):
                pass  # valid JSON that YAML cannot compose (tabs): values without lines
            else:
                raise
        try:
            data = json.loads(text, object_pairs_hook=_json_pairs(where))
        except json.JSONDecodeError as error:
            raise UserError(Problem("", f"not valid JSON: {error.msg}", f"{where}:{error.lineno}")) from None
        except RecursionError:
            raise UserError(Problem("", f"nested more than {MAX_DEPTH} levels deep", where,
                                    "a run config needs a few levels; check the brackets")) from None
        if _depth(data) > MAX_DEPTH:
            raise UserError(Problem("", f"nested more than {MAX_DEPTH} levels deep", where,
                                    "a run config needs a few levels; check the brackets"))
        return data, lines
    data, node = _compose(text, where)
    return data, _line_map(node) if node is not None else {}


def _depth(data: Any) -> int:
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_DEPTH:
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_value(text: str, where: str) -> Any:
    """A value typed on the command line or in the environment (`{"n_layer": 2}`, `[1, 2]`)."""
    data, _ = _compose(text, where)
    return data


def read_text(path: str | Path, what: str = "config file") -> str:
    path = Path(path)
    if path.is_dir():
        raise UserError(Problem("", f"{what} {path} is a directory", fix="give the path of a file"))
    if not path.is_file():
        raise UserError(Problem("", f"{what} not found: {path}",
                                fix="check the path (relative paths start from the current directory)"))
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(Problem("", f"cannot read {what} {path}: {error.strerror or error}")) from None
    return decode(raw, str(path))


def load_file(path: str | Path, what: str = "config file") -> LoadedFile:
    path = Path(path)
    text = read_text(path, what)
    data, lines = parse_text(text, str(path), json_first=path.suffix.lower() == ".json")
    if data is None:
        raise UserError(Problem("", f"{what} {path} is empty (nothing but blank lines or comments)", str(path),
                                "is it truncated or the wrong file? For all defaults, pass no file"))
    if not isinstance(data, dict):
        raise UserError(Problem("", f"a {what} must hold a mapping of keys to values, not a "
                                    f"{type(data).__name__}", str(path)))
    return LoadedFile(path=path, data=data, lines=lines)
