"""The schema seen as a flat set of dotted keys: lookup, string parsing and did-you-mean."""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any, Iterable, Mapping, Union, get_args, get_origin

from typing_extensions import TypeGuard

from pydantic import BaseModel, TypeAdapter, ValidationError

from overdrive.config.schema import OPEN_MAPPINGS, RunConfig, admits_bool
from overdrive.config.sources import parse_value
from overdrive.errors import UserError

# Short names accepted on the command line and in overrides (`lr=3e-4`).
ALIASES: dict[str, str] = {
    "lr": "optim.lr",
    "learning_rate": "optim.lr",
    "batch_size": "training.micro_batch_size",
    "micro_batch_size": "training.micro_batch_size",
    "mbs": "training.micro_batch_size",
    "accum": "training.gradient_accumulation_steps",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "steps": "training.max_steps",
    "max_steps": "training.max_steps",
    "seed": "training.seed",
    "clip": "training.gradient_clipping",
    "precision": "precision.mixed_precision",
    "mixed_precision": "precision.mixed_precision",
    "strategy": "parallel.strategy",
    "zero_stage": "parallel.deepspeed.zero_stage",
    "zero": "parallel.deepspeed.zero_stage",
    "nproc": "launch.num_processes",
    "num_processes": "launch.num_processes",
    "seq_len": "data.max_length",
    "max_length": "data.max_length",
    "model": "model.name_or_path",
    "data": "data.source",
    "compile": "compile.backend",
    "out": "output_dir",
}


def _is_section(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


@functools.lru_cache(maxsize=1)
def leaf_annotations() -> dict[str, Any]:
    """Every leaf key of the schema (open mappings count as leaves) and its type."""
    leaves: dict[str, Any] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            key = f"{prefix}{name}"
            if _is_section(info.annotation):
                walk(info.annotation, key + ".")
            else:
                leaves[key] = info.annotation

    walk(RunConfig, "")
    return leaves


@functools.lru_cache(maxsize=1)
def section_keys() -> frozenset[str]:
    sections: set[str] = set()
    for leaf in leaf_annotations():
        parts = leaf.split(".")
        sections.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(sections)


def open_mapping_of(key: str) -> str | None:
    """The open mapping a key belongs to (`model.architecture.n_layer` -> `model.architecture`)."""
    for mapping in OPEN_MAPPINGS:
        if key == mapping or key.startswith(mapping + "."):
            return mapping
    return None


def is_known(key: str) -> bool:
    return key in leaf_annotations() or open_mapping_of(key) is not None


def children(prefix: str) -> list[str]:
    """Names directly under a section (`""` is the top level)."""
    depth = 0 if not prefix else prefix.count(".") + 1
    names = set()
    for key in list(leaf_annotations()) + list(section_keys()):
        if not prefix or key.startswith(prefix + "."):
            parts = key.split(".")
            if len(parts) > depth:
                names.add(parts[depth])
    return sorted(names)


def expand_alias(key: str) -> str:
    return ALIASES.get(key, key)


def suggest(key: str) -> str:
    """A ` (did you mean ...?)` hint for an unknown dotted key, or an empty string."""
    prefix, _, name = key.rpartition(".")
    siblings = children(prefix) if prefix in section_keys() or not prefix else []
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        return f" (did you mean `{(prefix + '.' if prefix else '') + close[0]}`?)"
    # The right name in the wrong section: `training.lr` -> `optim.lr`.
    everything = list(leaf_annotations()) + list(ALIASES)
    by_name = {k.rpartition(".")[2]: k for k in everything}
    close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.75)
    if close:
        return f" (did you mean `{expand_alias(by_name[close[0]])}`?)"
    close = difflib.get_close_matches(key, everything, n=1, cutoff=0.6)
    return f" (did you mean `{expand_alias(close[0])}`?)" if close else ""


def annotation_for(key: str) -> Any:
    return leaf_annotations().get(key)


def _accepts_none(annotation: Any) -> bool:
    return get_origin(annotation) is Union and type(None) in get_args(annotation)


def _is_plain_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Union:
        return str in get_args(annotation)
    return False


@functools.lru_cache(maxsize=None)
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


def parse_string(key: str, text: str) -> Any:
    """Turn a string from the environment, the command line or a lax file into the value the
    field's type wants (`"3"` -> 3 for an int, `"a,b"` -> ["a", "b"] for a list).

    A string that cannot be read as the type is returned unchanged, so that validation
    reports it with its origin instead of this function guessing.
    """
    annotation = annotation_for(key)
    if annotation is None:  # inside an open mapping: read it as YAML would
        return _yaml_scalar(text, key)
    if _accepts_none(annotation) and text.strip().lower() in ("", "null", "none", "~"):
        return None
    if _is_plain_str(annotation):
        return text
    if get_origin(annotation) is list and _is_section(get_args(annotation)[0]):
        return _yaml_scalar(text, key)  # a list of entries (data.sources): validation names the entry's key
    adapter = _adapter(annotation)
    attempts = [text, _yaml_scalar(text, key)]
    if "," in text and not text.strip().startswith(("[", "(")):
        attempts.append([part.strip() for part in text.split(",") if part.strip()])
    if text.strip().startswith("(") and text.strip().endswith(")"):  # "(false, false, false)"
        attempts.append(_yaml_scalar("[" + text.strip()[1:-1] + "]"))
    attempts.append([text.strip()])  # one class name for a list of class names
    for attempt in attempts:
        if isinstance(attempt, bool) and not admits_bool(annotation):
            continue  # `true` is not 1: validation reports it with its origin
        try:
            return adapter.validate_python(attempt)
        except (ValidationError, TypeError, ValueError):
            continue
    number = _integral_float(text)
    if number is not None:
        try:
            return adapter.validate_python(number)
        except ValidationError:
            pass
    return text


def _yaml_scalar(text: str, where: str = "value") -> Any:
    try:
        value = parse_value(text, where)
    except UserError as error:
        if all(problem.message.startswith(("not valid YAML", "unsafe")) for problem in error.problems):
            return text  # not YAML: a plain string, validated as such
        raise  # nested too deeply or too large: refused, not passed on
    if isinstance(value, str):
        number = _integral_float(value)
        if number is not None:
            return number
        try:  # YAML 1.1 reads `1e-3` as a string; JSON reads it as a number
            return json.loads(value)
        except ValueError:
            return value
    return value


def _integral_float(text: str) -> int | float | None:
    try:
        number = float(text)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() and abs(number) < 2**63 else None


def coerce(key: str, value: Any) -> Any:
    """Normalise a value from any layer before validation."""
    if isinstance(value, str):
        return parse_string(key, value)
    annotation = annotation_for(key)
    if isinstance(value, float) and value.is_integer() and annotation is not None:
        # DeepSpeed JSON writes sizes as 2e8: an int field should take it as 200000000.
        try:
            _adapter(annotation).validate_python(value, strict=True)
        except ValidationError:
            try:
                return _adapter(annotation).validate_python(int(value))
            except ValidationError:
                return value
    return value


def flatten(values: Mapping[str, Any], prefix: str = "", keep_whole: Iterable[str] = ()) -> dict[str, Any]:
    """Nested values (a config's JSON dump, a saved config) -> {dotted key: value}.

    Non-empty mappings are walked, open ones (model.architecture, deepspeed extra) entry by
    entry; an empty mapping stays a value, so "no entries" is still compared. Mappings whose
    dotted key is in `keep_whole` stay one value.
    """
    whole = frozenset(keep_whole)
    flat: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and path not in whole:
            flat.update(flatten(value, path + ".", whole))
        else:
            flat[path] = value
    return flat


def unflatten(values: Mapping[str, Any]) -> dict[str, Any]:
    """{dotted key: value} -> nested sections (the inverse of `flatten`), as a config file writes them."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        node = nested
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def set_dotted(values: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` (dotted) in nested values, making the mappings on the way; a value that is not
    a mapping on the way leaves `values` as it was."""
    node = values
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return
    node[parts[-1]] = value


def differs_from_default(config: RunConfig, dotted: str) -> bool:
    """Whether the setting at `dotted` (a key of the schema) is other than the schema's default:
    a key set to its default changes nothing, wherever it applies."""
    given, default = config, RunConfig()
    for part in dotted.split("."):
        given, default = getattr(given, part), getattr(default, part)
    return given != default
