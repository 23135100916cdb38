"""A DeepSpeed JSON checked as deeply as overdrive's own keys, against DeepSpeed's own config models.

DeepSpeed describes most of its blocks with pydantic models (DeepSpeedZeroConfig with its
offload models, DeepSpeedFP16Config, DeepSpeedBF16Config, the monitor configs, ...), all
subclasses of DeepSpeedConfigModel, which forbids unknown keys. Their field names and
aliases are read here from the installed DeepSpeed's source with `ast`, without importing
it: importing DeepSpeed takes seconds (torch and all its ops), reading a dozen source files
a fraction of that. So a misspelled key at any depth (`overlap_com`,
`offload_optimizer.pinn_memory`) is an error with a did-you-mean, naming the file and line,
before anything starts, as DeepSpeed itself would refuse it only once the workers run.

Blocks DeepSpeed reads key by key (activation_checkpointing, flops_profiler) are checked
against the keys its reader asks for. Top-level keys are checked against the names DeepSpeed's config reader
(deepspeed/runtime/config.py) and the modules it imports know; blocks DeepSpeed has removed
are refused. Without DeepSpeed installed the file is mapped unchecked, with a warning.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

# top-level key -> the DeepSpeedConfigModel subclass that reads its block
SECTION_MODELS = {
    "zero_optimization": "DeepSpeedZeroConfig",
    "fp16": "DeepSpeedFP16Config",
    "bf16": "DeepSpeedBF16Config",
    "bfloat16": "DeepSpeedBF16Config",
    "tensorboard": "TensorBoardConfig",
    "wandb": "WandbConfig",
    "csv_monitor": "CSVConfig",
    "comet": "CometConfig",
    "comms_logger": "CommsLoggerConfig",
    "compile": "CompileConfig",
    "hybrid_engine": "HybridEngineConfig",
    "tensor_parallel": "TPTrainingConfig",
}
# Blocks DeepSpeed reads by hand, not through a model.
_PLAIN_SECTIONS = {"optimizer": {"type", "params", "legacy_fusion"}, "scheduler": {"type", "params"}}
# Blocks read key by key with `get_scalar_param(block, CONSTANT, default)` in these modules:
# their keys are the constants those calls name.
HAND_READ = {"activation_checkpointing": "deepspeed.runtime.activation_checkpointing.config",
             "flops_profiler": "deepspeed.profiling.config"}
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class Model:
    """What DeepSpeed's source says of one config model: its keys, and the models nested in them."""

    name: str
    bases: list[str]
    path: Path
    module: str
    fields: dict[str, list[str]] = field(default_factory=dict)  # key or alias -> referenced class names
    closed: bool = True  # extra="forbid", as DeepSpeedConfigModel


@functools.lru_cache(maxsize=1)
def _root() -> Optional[Path]:
    spec = importlib.util.find_spec("deepspeed")
    return Path(spec.origin).parent if spec and spec.origin else None


def _module_file(module: str) -> Optional[Path]:
    root = _root()
    parts = module.split(".")
    if root is None or parts[0] != "deepspeed":
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _imported_files(path: Path, module: str) -> list[Path]:
    """The deepspeed modules `path` (module name `module`) imports from."""
    files = []
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            candidates = [name] + [f"{name}.{alias.name}" for alias in node.names]
            files += [f for f in map(_module_file, candidates) if f is not None]
    return files


READER = "deepspeed.runtime.config"


def _module_name(path: Path) -> str:
    relative = path.relative_to(_root()).with_suffix("").parts
    return ".".join(("deepspeed",) + tuple(p for p in relative if p != "__init__"))


def _reader_files() -> list[Path]:
    reader = _module_file(READER)
    if reader is None:
        return []
    return list(dict.fromkeys([reader, *_imported_files(reader, READER)]))


@functools.lru_cache(maxsize=1)
def models() -> dict[str, Model]:
    """Config model classes defined in DeepSpeed's config reader and the files it imports;
    classes those models nest (offload configs) are added from their own imports on demand."""
    found: dict[str, Model] = {}
    for path in _reader_files():
        _read_file(path, found)
    for path in _reader_files()[1:]:  # a model defined one import further (tensor_parallel)
        wanted = set(SECTION_MODELS.values()) - set(found)
        if not wanted:
            break
        for imported in _imported_files(path, _module_name(path)):
            text = imported.read_text(encoding="utf-8")
            if any(f"class {name}(" in text for name in wanted):
                _read_file(imported, found)
    return found


def _read_file(path: Path, into: dict[str, Model]) -> None:
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef):
            into.setdefault(node.name, _read_class(node, path))


def _model_named(name: str, near: Model) -> Optional[Model]:
    found = models()
    if name not in found:
        for path in _imported_files(near.path, near.module):
            _read_file(path, found)
    return found.get(name)


def _read_class(node: ast.ClassDef, path: Path) -> Model:
    model = Model(node.name, [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases],
                  path, _module_name(path))
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names = [n.id for n in ast.walk(statement.annotation) if isinstance(n, ast.Name)]
            names += [n.value for n in ast.walk(statement.annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            model.fields[statement.target.id] = names
            if isinstance(statement.value, ast.Call):
                for keyword in statement.value.keywords:
                    if keyword.arg == "alias" and isinstance(keyword.value, ast.Constant):
                        model.fields[str(keyword.value.value)] = names
        elif isinstance(statement, ast.Assign) and any(getattr(t, "id", "") == "model_config" for t in statement.targets):
            extra = [k.value.value for k in getattr(statement.value, "keywords", [])
                     if k.arg == "extra" and isinstance(k.value, ast.Constant)]
            model.closed = not extra or extra[0] == "forbid"
    return model


def _fields(name: str, near: Optional[Model] = None, seen: tuple[str, ...] = ()) -> Optional[dict[str, list[str]]]:
    """Keys of a config model with those of its bases; None when it is not a closed config model."""
    model = _model_named(name, near) if near is not None else models().get(name)
    if model is None or name in seen or not model.closed:
        return None
    fields: dict[str, list[str]] = {}
    for base in model.bases:
        if base == "DeepSpeedConfigModel":
            continue
        inherited = _fields(base, model, seen + (name,))
        if inherited is None:
            return None  # a base this reading does not know: no claim about its keys
        fields.update(inherited)
    if "DeepSpeedConfigModel" not in model.bases and not any(base in models() for base in model.bases):
        return None
    fields.update(model.fields)
    return fields


@functools.lru_cache(maxsize=1)
def top_level_keys() -> frozenset[str]:
    """Every name DeepSpeed's config reader and the modules it imports know."""
    names: set[str] = set(SECTION_MODELS) | set(_PLAIN_SECTIONS)
    for path in _reader_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
                names.add(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return frozenset(names - set(removed_keys()))


@functools.lru_cache(maxsize=None)
def removed_keys(table: str = "_REMOVED_TOP_LEVEL_CONFIG_KEYS") -> dict[str, str]:
    """Keys DeepSpeed refuses as removed (top level, or `_REMOVED_ZERO_CONFIG_KEYS`), with the
    first sentence of its reason."""
    reader = _module_file(READER)
    removed: dict[str, str] = {}
    for node in ast.walk(_tree(reader)) if reader else ():
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == table for t in node.targets) \
                and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                text = "".join(part.value for part in ast.walk(value) if isinstance(part, ast.Constant) and isinstance(part.value, str))
                removed[str(getattr(key, "value", ""))] = text.split(". ")[0].rstrip(".") + "."
    return removed


@functools.lru_cache(maxsize=None)
def hand_read_keys(block: str) -> Optional[frozenset[str]]:
    """The keys DeepSpeed's reader of `block` asks for, or None when it cannot be read."""
    path = _module_file(HAND_READ[block])
    if path is None:
        return None
    constants: dict[str, str] = {}
    for source in [path, *_imported_files(path, HAND_READ[block])]:
        for node in _tree(source).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                constants.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    asked = {call.args[1].id for call in ast.walk(_tree(path)) if isinstance(call, ast.Call)
             and getattr(call.func, "id", "") == "get_scalar_param" and len(call.args) > 1 and isinstance(call.args[1], ast.Name)}
    keys = frozenset(constants[name] for name in asked if name in constants)
    return keys if keys and len(keys) == len(asked) else None


def _hint(name: str, candidates) -> str:
    close = difflib.get_close_matches(str(name), sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def check(data: Mapping[str, Any], c) -> None:
    """Report every unknown key of a DeepSpeed JSON through the collector `c` (error/warn by path)."""
    if _root() is None or not models():
        c.warn((), "DeepSpeed is not installed: this DeepSpeed config was not checked against its models",
               "pip install deepspeed")
        return
    known = top_level_keys()
    removed = removed_keys()
    for key, value in data.items():
        if key in removed:
            c.error((key,), f"removed from DeepSpeed: {removed[key]}", "remove the block")
        elif key in _PLAIN_SECTIONS:
            _check_plain(key, value, c)
        elif key in HAND_READ and isinstance(value, Mapping) and hand_read_keys(key):
            for name in [name for name in value if name not in hand_read_keys(key)]:
                c.error((key, name), f"not a key of `{key}`" + _hint(name, hand_read_keys(key)),
                        "remove it or fix its spelling (DeepSpeed would ignore it)")
        elif key in SECTION_MODELS:
            if isinstance(value, Mapping):
                _check_model(SECTION_MODELS[key], value, (key,), c)
                gone = removed_keys("_REMOVED_ZERO_CONFIG_KEYS") if key == "zero_optimization" else {}
                for name in [name for name in value if name in gone]:
                    c.error((key, name), f"removed from DeepSpeed: {gone[name]}", "remove the key")
            elif not isinstance(value, bool) or key == "compile":  # `"fp16": true` is not a block
                c.error((key,), f"must be a mapping of keys to values, got {value!r}")
        elif key not in known:
            c.error((key,), "not a DeepSpeed config key" + _hint(key, known), "remove it or fix its spelling")


def _check_model(name: str, block: Mapping[str, Any], path: tuple[str, ...], c, near: Optional[Model] = None) -> None:
    fields = _fields(name, near)
    model = _model_named(name, near) if near is not None else models().get(name)
    if fields is None or model is None:
        return
    for key, value in block.items():
        if key not in fields:
            c.error(path + (key,), f"not a key of `{'.'.join(path)}`" + _hint(key, fields),
                    f"remove it or fix its spelling (DeepSpeed's {name} would refuse it)")
        elif isinstance(value, Mapping):
            for nested in fields[key]:
                if _fields(nested, model) is not None:
                    _check_model(nested, value, path + (key,), c, model)
                    break


def _check_plain(key: str, value: Any, c) -> None:
    if not isinstance(value, Mapping):
        c.error((key,), f"must be a mapping, got {value!r}")
        return
    for name, inner in value.items():
        if name not in _PLAIN_SECTIONS[key]:
            c.error((key, name), f"not a key of `{key}`" + _hint(name, _PLAIN_SECTIONS[key]),
                    f"`{key}` takes {', '.join(sorted(_PLAIN_SECTIONS[key]))}")
        elif name == "params" and not isinstance(inner, Mapping):
            c.error((key, name), f"must be a mapping of parameter names to values, got {inner!r}")
