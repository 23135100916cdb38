"""The six configuration layers and the provenance of every value.

Precedence, lowest to highest, written down once:

    1. default             the schema's defaults
    2. accelerate-default  Accelerate's own default_config.yaml, if present
    3. file                config files in the order given (each after what it `extends:`);
                           Accelerate YAML/JSON and DeepSpeed JSON are mapped into the schema
    4. env                 ACCELERATE_* / FSDP_* variables Accelerate reads, OVERDRIVE_<SECTION>__<KEY>
    5. cli                 `key=value` arguments (dotted paths or short aliases)
    6. override            `overrides={...}` passed to load_config()

Every layer turns its source into a list of `Setting`s (dotted key, value, origin); the
merge keeps, per key, the whole chain of settings so `explain --key` can show who lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from overdrive.config import keys, redact
from overdrive.config.env_report import is_secret_name
from overdrive.config.provenance import LayerOutput, Origin, Setting
from overdrive.config.schema import OPEN_MAPPINGS, RunConfig
from overdrive.config.sources import load_file, parse_value
from overdrive.errors import Problem, UserError
from overdrive.interop import reading as native
from overdrive.interop import tool_reading

LAYERS = ("default", "accelerate-default", "file", "env", "cli", "override")
META_KEYS = ("extends", "layer")
# A file's `layer:` label is free, except for the names of the layers it is not.
RESERVED_LABELS = frozenset(LAYERS) - {"file"}


def flatten_schema_mapping(data: Mapping[str, Any], origin_for, prefix: str = "") -> LayerOutput:
    """Walk a nested mapping written in overdrive's own schema into settings.

    `origin_for(path_tuple)` gives the origin of each key. Dotted keys are accepted at any
    level (`optim.lr: 3e-4`). Unknown keys become errors with a did-you-mean.
    """
    out = LayerOutput()
    for raw_key, value in data.items():
        raw_key = str(raw_key)
        path = prefix + raw_key if not prefix else f"{prefix}.{raw_key}"
        if not prefix and raw_key in META_KEYS:
            continue
        origin = origin_for(path)
        if path in OPEN_MAPPINGS and not isinstance(value, Mapping):
            out.errors.append(_not_a_mapping(path, value, origin))
        elif keys.open_mapping_of(path) is not None:
            if isinstance(value, Mapping) and path in keys.leaf_annotations():
                if not value:
                    out.settings.append(Setting(path, {}, origin))
                out.extend(flatten_schema_mapping(value, origin_for, path)) if value else None
            else:
                out.settings.append(Setting(path, value, origin))
        elif path in keys.section_keys():
            if isinstance(value, Mapping):
                out.extend(flatten_schema_mapping(value, origin_for, path))
            elif value is not None:
                out.errors.append(Problem(path, f"is a section and needs a mapping of keys, got {value!r}", str(origin)))
        elif path in keys.leaf_annotations():
            out.settings.append(Setting(path, value, origin))
        else:
            out.errors.append(Problem(path, "unknown key" + keys.suggest(path), str(origin),
                                      "see `overdrive explain` or docs/config.md for the valid keys"))
    return out


def _not_a_mapping(key: str, value: Any, origin: Origin) -> Problem:
    return Problem(key, f"needs a mapping of keys to values, got {redact.shown(key, value)!r}", str(origin),
                   f"e.g. {key}={_EXAMPLES.get(key, '{...}')} on the command line, or a block of `key: value` lines in a file")


_EXAMPLES = {"model.architecture": '{"n_layer": 2}', "parallel.deepspeed.extra": '{"steps_per_print": 10}'}


def typed_setting(key: str, text: str, origin: Origin) -> LayerOutput:
    """A `key=value` from the command line or the environment. A whole open mapping
    (`model.architecture={"n_layer": 2}`) is read as YAML/JSON flow syntax and merged key by
    key over the lower layers, as the same block in a file would be; anything but a mapping
    is refused."""
    if key not in OPEN_MAPPINGS:
        return LayerOutput(settings=[Setting(key, text, origin)])
    try:
        value = parse_value(text, str(origin)) if text.strip() else None
    except UserError as error:
        return LayerOutput(errors=[Problem(key, problem.message, str(origin), problem.fix) for problem in error.problems])
    if not isinstance(value, Mapping):
        return LayerOutput(errors=[_not_a_mapping(key, text, origin)])
    return flatten_schema_mapping({key: value}, lambda _: origin)


def defaults_layer() -> LayerOutput:
    origin = Origin("default")
    return flatten_schema_mapping(RunConfig().model_dump(mode="python"), lambda _: origin)


def _origin_in_file(layer: str, loaded) -> Any:
    def origin_for(path: str) -> Origin:
        return Origin(layer, str(loaded.path), loaded.line(*path.split(".")))

    return origin_for


def file_layer(path: str | Path, layer: str = "file", _stack: tuple[Path, ...] = ()) -> LayerOutput:
    """One config file, after the files it `extends:` (relative to itself)."""
    loaded = load_file(path)
    resolved_path = Path(path).resolve()
    out = LayerOutput()
    bases = loaded.data.get("extends")
    bases = [] if bases is None else [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(base, str) and base.strip() for base in bases):
        out.errors.append(Problem("extends", f"must be a file path or a list of file paths, got {loaded.data['extends']!r}",
                                  loaded.where("extends"), "e.g. `extends: base.yaml` or `extends: [a.yaml, b.yaml]`"))
        bases = []
    label = loaded.data.get("layer")
    if label is not None and (not isinstance(label, str) or label in RESERVED_LABELS):
        reserved = isinstance(label, str)
        out.errors.append(Problem("layer", f"{label!r} cannot label a file: {'it names another layer' if reserved else 'a label is a word'}",
                                  loaded.where("layer"), "a short word such as `tune`, or remove the key"))
        label = None
    for base in bases:
        base_path = (loaded.path.parent / base).resolve()
        if base_path in _stack + (resolved_path,):
            cycle = " -> ".join(str(p) for p in _stack + (resolved_path, base_path))
            out.errors.append(Problem("extends", f"cycle: {cycle}", loaded.where("extends"), "remove one of the extends"))
            continue
        out.extend(file_layer(base_path, layer, _stack + (resolved_path,)))
    kind = tool_reading.detect_kind(loaded.data)
    if kind == "overdrive":
        own_layer = label or layer
        out.extend(flatten_schema_mapping(loaded.data, _origin_in_file(own_layer, loaded)))
    else:
        out.extend(tool_reading.map_file(loaded, kind, layer))
    return out


def accelerate_default_layer(path: Path | None) -> LayerOutput:
    if path is None or not path.is_file():
        return LayerOutput()
    out = file_layer(path, layer="accelerate-default")
    if out.settings:
        changed = sorted({s.key for s in out.settings})
        out.warnings.insert(0, Problem(
            "", f"Accelerate's default config {path} is in effect and sets: {', '.join(changed)}",
            str(path), "delete or update that file if it is stale, or pass --no-accelerate-default",
        ))
    return out


def env_layer(environ: Mapping[str, str]) -> LayerOutput:
    from overdrive.resolving.env_lookalikes import lookalike_warnings

    out = native.map_accelerate_env(environ)
    out.warnings += lookalike_warnings(environ)
    for name, value in sorted(environ.items()):
        if not name.startswith("OVERDRIVE_") or "__" not in name and name != "OVERDRIVE_OUTPUT_DIR":
            continue
        key = ".".join(part.lower() for part in name[len("OVERDRIVE_"):].split("__"))
        origin = Origin("env", name)
        if keys.is_known(key):
            out.extend(typed_setting(key, value, origin))
        else:
            out.errors.append(Problem(key, "unknown key" + keys.suggest(key), str(origin),
                                      "OVERDRIVE_<SECTION>__<KEY>, e.g. OVERDRIVE_OPTIM__LR=3e-4"))
    return out


def cli_layer(arguments: Iterable[str]) -> LayerOutput:
    out = LayerOutput()
    for argument in arguments:
        key, sep, value = argument.partition("=")
        if not sep or not key:
            out.errors.append(Problem(argument, "expected key=value", "cli", "e.g. optim.lr=3e-4 or lr=3e-4"))
            continue
        key = keys.expand_alias(key.strip())
        # The origin is printed by explain and kept in resolved.json: never a credential.
        origin = Origin("cli", f"{argument.partition('=')[0]}=***" if is_secret_name(key) else argument)
        if keys.is_known(key):
            out.extend(typed_setting(key, value, origin))
        elif key in keys.section_keys():
            out.errors.append(Problem(key, "is a section; set one of its keys", str(origin),
                                      f"one of: {', '.join(keys.children(key))}"))
        else:
            out.errors.append(Problem(key, "unknown key" + keys.suggest(key), str(origin)))
    return out


def overrides_layer(overrides: Mapping[str, Any] | None) -> LayerOutput:
    if not overrides:
        return LayerOutput()
    expanded = {keys.expand_alias(str(k)): v for k, v in overrides.items()}
    origin = Origin("override", "load_config(overrides=...)")
    return flatten_schema_mapping(expanded, lambda _: origin)


def merge(layer_outputs: Iterable[LayerOutput]) -> dict[str, list[Setting]]:
    """Per key, every setting in precedence order; the last one wins."""
    chains: dict[str, list[Setting]] = {}
    for output in layer_outputs:
        for setting in output.settings:
            if setting.key == "model.architecture.model_type":
                _drop_architecture_of_other_type(chains, setting)
            chains.setdefault(setting.key, []).append(setting)
    return chains


def _drop_architecture_of_other_type(chains: dict[str, list[Setting]], setting: Setting) -> None:
    # Keys of a GPT-2 architecture mean nothing to a Llama config: a layer that names another
    # model_type starts the architecture afresh instead of inheriting the default's keys.
    current = chains.get("model.architecture.model_type")
    if current and current[-1].value != setting.value:
        for key in [k for k in chains if k.startswith("model.architecture.")]:
            if key != "model.architecture.model_type" and all(s.origin.layer != setting.origin.layer or s.origin.source != setting.origin.source for s in chains[key]):
                del chains[key]


def nest(chains: Mapping[str, list[Setting]]) -> dict[str, Any]:
    """The winning values as the nested mapping the pydantic model validates."""
    nested: dict[str, Any] = {}
    for key in sorted(chains, key=lambda k: k.count(".")):
        value = keys.coerce(key, chains[key][-1].value)
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if isinstance(value, Mapping) and isinstance(node.get(parts[-1]), dict):
            continue  # an open mapping already filled by its sub-keys
        node[parts[-1]] = dict(value) if isinstance(value, Mapping) else value
    return nested
