"""A DeepSpeed JSON checked as deeply as overdrive's own keys, by DeepSpeed's own config models.

Sections DeepSpeed describes with pydantic models (zero_optimization with its offload
blocks, fp16, bf16, the monitors, comms_logger, compile, hybrid_engine, tensor_parallel) are
validated by those very models: a misspelled key at any depth (`overlap_com`,
`offload_param.pinn_memory`) or a value of the wrong type is an error with a did-you-mean.
Top-level keys are checked against the names DeepSpeed's config reader knows (its
constants, its models' fields and the literal names in `deepspeed/runtime/config.py`);
blocks DeepSpeed has removed are refused with DeepSpeed's own words.

Importing DeepSpeed costs seconds, so this runs only when a DeepSpeed file is read.
Without DeepSpeed installed, the file is mapped unchecked and a warning says so.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import re
import sys
from typing import Any, Mapping, Optional, Union, get_args, get_origin

# top-level key -> (module, class) of the DeepSpeed model that validates its block
SECTION_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "bfloat16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "hybrid_engine": ("deepspeed.runtime.config", "HybridEngineConfig"),
    "tensor_parallel": ("deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
}
# Keys overdrive maps onto its own schema: their values are checked there (and written back
# to DeepSpeed from it); DeepSpeed's models check the names of every key and the values of
# everything passed through verbatim.
_MAPPED = {
    "zero_optimization": {"stage", "offload_optimizer", "offload_param", "overlap_comm", "contiguous_gradients",
                          "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                          "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                          "stage3_max_reuse_distance", "sub_group_size", "stage3_gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"},
    "fp16": {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"},
    "bf16": {"enabled"},
    "bfloat16": {"enabled"},
}
# Blocks read by hand in DeepSpeed, not by a model: their keys are its constants.
_PLAIN_SECTIONS = {"optimizer": {"type", "params", "legacy_fusion"}, "scheduler": {"type", "params"}}
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


@functools.lru_cache(maxsize=1)
def _config_module():
    import logging

    # DeepSpeed announces on stdout the accelerator it picks when first imported: noise for a
    # config check, and it would end up inside `overdrive import ds.json > run.yaml`.
    logging.getLogger("DeepSpeed").addFilter(_QuietAcceleratorChoice())
    return importlib.import_module("deepspeed.runtime.config")


class _QuietAcceleratorChoice:
    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Setting accelerator to")


@functools.lru_cache(maxsize=1)
def top_level_keys() -> frozenset[str]:
    """Every name DeepSpeed's config reader knows at the top of a config."""
    module = _config_module()
    from pydantic import BaseModel

    names: set[str] = set(SECTION_MODELS) | set(_PLAIN_SECTIONS)
    for name, loaded in list(sys.modules.items()):
        if not name.startswith("deepspeed") or loaded is None:
            continue
        for attribute, value in vars(loaded).items():
            if attribute.isupper() and isinstance(value, str) and _NAME.fullmatch(value):
                names.add(value)
            elif isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == name:
                names.update(value.model_fields)
    # Literal names read in the config reader itself (`param_dict.get('compile', {})`).
    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
            names.add(node.value)
    return frozenset(names - set(removed_keys()))


def removed_keys() -> dict[str, str]:
    return dict(getattr(_config_module(), "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))


def _model(section: str):
    module_name, class_name = SECTION_MODELS[section]
    return getattr(importlib.import_module(module_name), class_name, None)


def _submodel(annotation: Any):
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is Union or get_origin(annotation) is Optional:
        for arg in get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def _names_at(model, loc: tuple) -> list[str]:
    """Field names and aliases of the (sub)model a pydantic error location points into."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        sub = _submodel(field.annotation) if field is not None else None
        if sub is None:
            return []
        model = sub
    names = list(model.model_fields)
    names += [f.alias for f in model.model_fields.values() if f.alias]
    return names


def _hint(name: str, candidates) -> str:
    close = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def check(data: Mapping[str, Any], c) -> None:
    """Report every problem of a DeepSpeed JSON through the collector `c` (error/warn by path)."""
    if not _deepspeed_available():
        c.warn((), "DeepSpeed is not installed: this DeepSpeed config was not checked against its models",
               "pip install deepspeed")
        return
    known = top_level_keys()
    removed = removed_keys()
    for key, value in data.items():
        if key in removed:
            c.error((key,), f"removed from DeepSpeed: {removed[key]}", "remove the block")
        elif key in SECTION_MODELS:
            _check_section(key, value, c)
        elif key in _PLAIN_SECTIONS:
            _check_plain(key, value, c)
        elif key not in known:
            c.error((key,), "not a DeepSpeed config key" + _hint(key, known), "remove it or fix its spelling")


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


def _without_auto(node: Any) -> Any:
    # "auto" is filled in by Accelerate before DeepSpeed sees the config.
    if isinstance(node, Mapping):
        return {k: _without_auto(v) for k, v in node.items() if not (isinstance(v, str) and v.strip().lower() == "auto")}
    return node


def _check_section(key: str, value: Any, c) -> None:
    import logging

    from pydantic import ValidationError

    if not isinstance(value, Mapping):
        if key == "compile" or not isinstance(value, bool):
            c.error((key,), f"must be a mapping of keys to values, got {value!r}")
        return
    model = _model(key)
    if model is None:
        return
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)  # deprecation notes are DeepSpeed's, and repeated per rank later
    try:
        model(**_without_auto(value))
    except ValidationError as error:
        for item in error.errors():
            loc = tuple(str(part) for part in item["loc"])
            if item["type"] == "extra_forbidden":
                c.error((key, *loc), f"not a key of `{'.'.join((key, *loc[:-1]))}`" + _hint(loc[-1], _names_at(model, loc)),
                        "remove it or fix its spelling (DeepSpeed would refuse it)")
            elif loc and loc[0] in _MAPPED.get(key, ()):
                continue
            else:
                got = item.get("input")
                c.error((key, *loc), f"{item['msg']} (got {got!r})" if not isinstance(got, Mapping) else item["msg"])
    except Exception as error:  # DeepSpeed's own asserts on combinations (deprecated + new key together)
        c.error((key,), f"refused by DeepSpeed: {error}")
    finally:
        logger.setLevel(level)
