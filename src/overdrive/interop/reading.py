"""Accelerate's and DeepSpeed's own config files, read as they are and mapped into the schema.

Recognised by their keys, not their names. Accelerate YAML/JSON covers every ClusterConfig
key, the nested deepspeed_config / fsdp_config / dynamo_config / fp8_config sections and the
legacy forms (`fp16: true`, top-level `dynamo_backend`, YAML 1.1's bare `NO` read as false).
DeepSpeed JSON covers `"auto"` values, the legacy `bfloat16` section and
`stage3_gather_fp16_weights_on_model_save`; entries with no schema key are kept verbatim in
`parallel.deepspeed.extra`. What Accelerate would silently drop is reported as a warning; what overdrive
does not run (SageMaker, TPU, MPI hostfiles) is refused by key; Megatron-LM's: interop/megatron_reading.py.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from overdrive.interop.tables import (
    ACCELERATE_ENV_DIRECT,
    ACCELERATE_KEYS,
    ACCELERATE_TOP,
    DEEPSPEED_MARKERS,
    DISTRIBUTED_TYPES,
    DYNAMO_KEYS,
    FP8_KEYS,
    FSDP_KEYS,
    FSDP_SHARDING,
    SAGEMAKER_KEYS,
    TPU_ONLY_KEYS,
    ZERO_KEYS,
)
from overdrive.interop.deepspeed_reading import map_deepspeed
from overdrive.interop.megatron_reading import map_megatron
from overdrive.interop.parallelism_reading import map_parallelism, map_parallelism_env
from overdrive.interop.deepspeed_schema import check as check_deepspeed
from overdrive.config.keys import coerce
from overdrive.config.provenance import LayerOutput, Origin, Setting
from overdrive.config.sources import LoadedFile, load_file
from overdrive.errors import Problem

SCHEMA_SECTIONS = {"model", "tokenizer", "data", "optim", "scheduler", "training", "precision",
                   "parallel", "compile", "launch", "checkpoint", "logging", "output_dir", "extends", "layer"}


def detect_kind(data: Mapping[str, Any]) -> str:
    """`overdrive`, `accelerate` or `deepspeed`, by the keys at the top of the file."""
    top = {str(k).split(".")[0] for k in data}
    if any(k in data for k in ("distributed_type", "compute_environment", "deepspeed_config", "fsdp_config",
                               "dynamo_backend", "dynamo_config", "use_cpu", "machine_rank")):
        return "accelerate"
    # `scheduler` and `optimizer`-like names exist in both worlds; these exist only in DeepSpeed's.
    if top & (DEEPSPEED_MARKERS - SCHEMA_SECTIONS) or isinstance(data.get("fp16"), Mapping):
        return "deepspeed"
    if top & SCHEMA_SECTIONS:
        return "overdrive"
    if top & set(ACCELERATE_KEYS):
        return "accelerate"
    return "overdrive"


class _Collector:
    """Gathers settings, errors and warnings for one native source."""

    def __init__(self, origin_for: Callable[[tuple[str, ...]], Any], where: Callable[[tuple[str, ...]], str],
                 native: str = ""):
        self.out = LayerOutput()
        self.origin_for = origin_for
        self.where = where
        self.native = native

    def set(self, key: str, value: Any, *path: str) -> None:
        self.out.settings.append(Setting(key, value, self.origin_for(path), self.native))

    def error(self, path: tuple[str, ...], message: str, fix: str = "", settled_by: tuple[str, ...] = ()) -> None:
        self.out.errors.append(Problem(".".join(path), message, self.where(path), fix, settled_by))

    def warn(self, path: tuple[str, ...], message: str, fix: str = "") -> None:
        self.out.warnings.append(Problem(".".join(path), message, self.where(path), fix))


def map_file(loaded: LoadedFile, kind: str, layer: str):
    def origin_for(path: tuple[str, ...]) -> Origin:
        return Origin(layer, str(loaded.path), loaded.line(*path) or None)

    def where(path: tuple[str, ...]) -> str:
        return loaded.where(*path)

    if kind == "deepspeed":
        collector = _Collector(origin_for, where, native="deepspeed")
        check_deepspeed(loaded.data, collector)
        if collector.out.errors:
            return collector.out  # mapped only once DeepSpeed's own models accept it
        map_deepspeed(loaded.data, collector)
        collector.set("parallel.strategy", "deepspeed")
        collector.set("parallel.deepspeed.config_file", str(loaded.path))
        return collector.out
    collector = _Collector(origin_for, where)
    map_accelerate(loaded.data, collector, base_dir=loaded.path.parent, layer=layer)
    return collector.out


# --------------------------------------------------------------------------- Accelerate


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "yes", "1", "on") if isinstance(value, str) else bool(value)


def _distributed_type(value: Any) -> str:
    # YAML 1.1 reads a bare `NO` as false; Accelerate means DistributedType.NO.
    if value is False or value is None:
        return "NO"
    return str(value).upper()


def _as_int(value: Any) -> int | None:
    """An integer written as one (`2`, `"2"`, `2.0`), else None; never a boolean."""
    try:
        number = float(str(value).strip()) if not isinstance(value, bool) else 0.5
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


# Accelerate sections that must be mappings when present: anything else is refused first.
_SECTIONS = ("deepspeed_config", "fsdp_config", "dynamo_config", "fp8_config", "mpirun_config", "parallelism_config")


def map_accelerate(data: Mapping[str, Any], c: _Collector, base_dir: Path, layer: str) -> None:
    data = dict(data)
    for section in [s for s in _SECTIONS if data.get(s) is not None and not isinstance(data[s], Mapping)]:
        c.error((section,), f"must be a mapping of keys to values, got {data.pop(section)!r}")
    for key in data:
        if key not in ACCELERATE_KEYS:
            close = difflib.get_close_matches(str(key), ACCELERATE_KEYS, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            c.error((key,), f"not an Accelerate config key{hint}", "remove it or fix its spelling")

    environment = str(data.get("compute_environment") or "LOCAL_MACHINE").upper()
    if environment != "LOCAL_MACHINE":
        c.error(("compute_environment",), f"{environment} is not run by overdrive (it launches on machines you can reach)",
                "use `compute_environment: LOCAL_MACHINE` with launch.* keys, or `accelerate launch` for SageMaker")
        return
    for key in SAGEMAKER_KEYS:
        if data.get(key):
            c.error((key,), "is a SageMaker setting; overdrive does not launch SageMaker jobs", "remove it")

    dist = _distributed_type(data.get("distributed_type", "NO"))
    strategy = DISTRIBUTED_TYPES.get(dist)
    if strategy is None:
        c.error(("distributed_type",), f"{dist} is not run by overdrive",
                "use NO, MULTI_GPU, MULTI_CPU, DEEPSPEED, FSDP or MEGATRON_LM (TPU/XLA are not supported)")
    elif "distributed_type" in data:
        c.set("parallel.strategy", strategy, "distributed_type")
        if dist == "MULTI_CPU":
            c.set("launch.use_cpu", True, "distributed_type")
        elif dist not in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP", "MULTI_CPU", "MEGATRON_LM"):
            c.warn(("distributed_type",), f"{dist} runs as plain data parallel on whatever devices torch finds")

    _map_top_level(data, c)
    _map_refusals(data, c, dist)

    ds = data.get("deepspeed_config") or {}
    if ds and dist != "DEEPSPEED":
        c.warn(("deepspeed_config",), f"ignored: distributed_type is {dist}, so Accelerate drops this section")
    elif ds:
        _map_accelerate_deepspeed(ds, c, base_dir, layer, data)

    fsdp = data.get("fsdp_config") or {}
    if fsdp and dist != "FSDP":
        c.warn(("fsdp_config",), f"ignored: distributed_type is {dist}, so Accelerate drops this section")
    elif fsdp:
        _map_fsdp(fsdp, c)

    dynamo = dict(data.get("dynamo_config") or {})
    if "dynamo_backend" in data:  # legacy top-level form
        dynamo.setdefault("dynamo_backend", data["dynamo_backend"])
    _map_dynamo(dynamo, c, "dynamo_backend" in data)

    fp8 = data.get("fp8_config") or {}
    for key, value in fp8.items():
        target = FP8_KEYS.get(key)
        if target is None:
            c.error(("fp8_config", key), "not an fp8_config key" + _hint(key, FP8_KEYS))
        elif key == "backend":
            c.set(target, str(value).upper().replace("-", ""), "fp8_config", key)
        else:
            c.set(target, value, "fp8_config", key)


def _hint(key: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _map_top_level(data: Mapping[str, Any], c: _Collector) -> None:
    for key, target in ACCELERATE_TOP.items():
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if key == "mixed_precision":
            value = "no" if value in (False, None) else str(value).lower()
        elif key == "downcast_bf16":
            value = _truthy(value)
        elif key == "num_processes" and _as_int(value) is None:
            c.error((key,), f"must be a whole number, got {value!r}")
            continue
        elif key == "num_processes" and _as_int(value) < 1:
            continue  # -1: "decided at launch" in Accelerate
        c.set(target, value, key)
    if "fp16" in data and "mixed_precision" not in data and _truthy(data["fp16"]):
        c.set("precision.mixed_precision", "fp16", "fp16")  # pre-0.6 form


def _map_refusals(data: Mapping[str, Any], c: _Collector, dist: str) -> None:
    mpirun = data.get("mpirun_config") or {}
    if mpirun.get("mpirun_hostfile"):
        c.error(("mpirun_config", "mpirun_hostfile"), "MPI hostfiles are not used: overdrive starts CPU workers with torch.distributed.run",
                "remove mpirun_config and set launch.num_machines / launch.main_process_ip; run `overdrive train` on each machine")
    map_megatron(data, c, dist)
    block = data.get("parallelism_config")
    if block:
        map_parallelism(block, c)
    for key in TPU_ONLY_KEYS:
        if data.get(key):
            c.warn((key,), "ignored: used only by `accelerate tpu-config`")


def _map_accelerate_deepspeed(ds: Mapping[str, Any], c: _Collector, base_dir: Path, layer: str,
                              top: Mapping[str, Any]) -> None:
    path = ("deepspeed_config",)
    inline = {k: v for k, v in ds.items() if k not in ("deepspeed_config_file", "zero3_init_flag",
                                                         "deepspeed_moe_layer_cls_names")}
    for key, value in ds.items():
        target = ZERO_KEYS.get(key)
        if key in ("deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter"):
            c.error(path + (key,), "DeepSpeed's own multi-node launcher is not used: overdrive launches with torch.distributed.run",
                    "remove it and set launch.num_machines, launch.machine_rank, launch.main_process_ip")
        elif key == "deepspeed_multinode_launcher":
            # "standard" is Accelerate's torchrun-style launcher: what overdrive does anyway.
            if value not in (None, "standard"):
                c.warn(path + (key,), f"{value} ignored: overdrive launches with torch.distributed.run")
        elif key == "deepspeed_moe_layer_cls_names":
            c.warn(path + (key,), "ignored: ZeRO-3 gathers Transformers 5's stacked experts whole (parallel.ep_size)")
        elif key == "deepspeed_config_file":
            continue
        elif target is None:
            c.error(path + (key,), "not a deepspeed_config key" + _hint(key, ZERO_KEYS))
        elif value is not None:
            if key in ("offload_optimizer_nvme_path", "offload_param_nvme_path") and str(value).lower() == "none":
                continue
            c.set(target, value, *path, key)
    config_file = ds.get("deepspeed_config_file")
    if not config_file:
        return
    candidate = Path(os.path.normpath(base_dir / config_file))
    if not candidate.is_file() and Path(config_file).is_file():
        candidate = Path(config_file)  # Accelerate resolves against the working directory
    if not candidate.is_file():
        c.error(path + ("deepspeed_config_file",), f"DeepSpeed config file not found: {config_file}",
                f"looked in {base_dir} and the current directory")
        return
    if "mixed_precision" in top:
        inline["mixed_precision"] = top["mixed_precision"]
    loaded = load_file(candidate, "DeepSpeed config file")
    kind = detect_kind(loaded.data)
    if kind == "accelerate" or kind == "overdrive" and {str(k).split(".")[0] for k in loaded.data} & SCHEMA_SECTIONS:
        return c.error(path + ("deepspeed_config_file",), f"{candidate} is an {kind} config, not a DeepSpeed JSON",
                       "point deepspeed_config_file at a DeepSpeed config (zero_optimization, ...)")
    ds_out = map_file(loaded, "deepspeed", layer)
    _report_inline_conflicts(inline, ds_out, c, path)
    c.out.extend(ds_out)


def _report_inline_conflicts(inline: Mapping[str, Any], ds_out, c: _Collector, path: tuple[str, ...]) -> None:
    """Accelerate refuses inline deepspeed_config values next to a deepspeed_config_file;
    overdrive reports each one that disagrees with the file, naming both places."""
    from_file = {s.key: s for s in ds_out.settings}
    for key, value in inline.items():
        target = ZERO_KEYS.get(key) or ("precision.mixed_precision" if key == "mixed_precision" else None)
        if target is None or value is None:
            continue
        in_file = from_file.get(target)
        if in_file is not None and coerce(target, in_file.value) != coerce(target, value):
            where = path + (key,) if key != "mixed_precision" else ("mixed_precision",)
            c.error(where, f"{value!r} conflicts with {in_file.value!r} in the deepspeed_config_file ({in_file.origin.source}:{in_file.origin.line})",
                    "set it in one place only: remove the inline value or change the JSON")


def _map_fsdp(fsdp: Mapping[str, Any], c: _Collector) -> None:
    path = ("fsdp_config",)
    version = _as_int(fsdp.get("fsdp_version") or 1)
    if version not in (1, 2):
        c.error(path + ("fsdp_version",), f"must be 1 or 2, got {fsdp.get('fsdp_version')!r}")
        return
    if "fsdp_version" not in fsdp:
        c.warn(path, "no fsdp_version: Accelerate would run FSDP1, overdrive runs FSDP2 (fully_shard)",
               "add `fsdp_version: 2`, or set parallel.fsdp.version=1 to keep FSDP1 (GPU only)")
    for key, value in fsdp.items():
        target = FSDP_KEYS.get(key)
        if target is None:
            c.error(path + (key,), "not an fsdp_config key" + _hint(key, FSDP_KEYS))
            continue
        if value is None:
            continue
        if key == "fsdp_version":
            value = version
        if key == "fsdp_version" and version == 1:
            c.warn(path + (key,), "FSDP1 does not run on CPU; FSDP2 is the maintained API", "use fsdp_version: 2")
        if key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward") and not isinstance(value, bool) \
                and str(value).lower() not in ("true", "false"):
            name = FSDP_SHARDING.get(str(value).upper())
            if name is None:
                c.error(path + (key,), f"unknown sharding strategy {value!r}", f"one of: {', '.join(FSDP_SHARDING)}")
                continue
            reshard, note = name
            if note:
                c.warn(path + (key,), note)
            value = reshard
        elif key in ("fsdp_use_orig_params", "fsdp_forward_prefetch", "fsdp_backward_prefetch") and version == 2:
            c.warn(path + (key,), "has no effect under FSDP2; Accelerate drops it")
        if key == "fsdp_auto_wrap_policy":
            value = str(value).lower()
        elif key == "fsdp_backward_prefetch":
            value = None if str(value).upper() == "NO_PREFETCH" else str(value).lower()
        elif key == "fsdp_state_dict_type":
            value = str(value).lower()
            if value == "local_state_dict":
                c.error(path + (key,), "LOCAL_STATE_DICT is not supported", "use SHARDED_STATE_DICT or FULL_STATE_DICT")
                continue
        elif key == "fsdp_transformer_layer_cls_to_wrap" and isinstance(value, str):
            value = [name.strip() for name in value.split(",") if name.strip()]
        c.set(target, value, *path, key)


def _map_dynamo(dynamo: Mapping[str, Any], c: _Collector, legacy: bool) -> None:
    for key, value in dynamo.items():
        path = ("dynamo_backend",) if legacy and key == "dynamo_backend" else ("dynamo_config", key)
        target = DYNAMO_KEYS.get(key)
        if target is None:
            c.error(path, "not a dynamo_config key" + _hint(key, DYNAMO_KEYS))
        elif key == "dynamo_backend":
            backend = str(value).lower()
            c.set(target, None if backend in ("no", "false", "none") else backend, *path)
        elif value is not None:
            c.set(target, value, *path)


def map_accelerate_env(environ: Mapping[str, str]):
    """The variables Accelerate documents and reads, mapped like the config keys they mirror."""
    names: dict[tuple[str, ...], str] = {}
    pseudo: dict[str, Any] = {}
    for name, value in environ.items():
        if name in ACCELERATE_ENV_DIRECT:
            key = ACCELERATE_ENV_DIRECT[name]
            pseudo[key] = value
            names[(key,)] = name
        elif name.startswith("ACCELERATE_DEEPSPEED_") and name != "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES":
            key = name[len("ACCELERATE_DEEPSPEED_"):].lower()
            key = {"zero3_init": "zero3_init_flag", "config_file": "deepspeed_config_file"}.get(key, key)
            pseudo.setdefault("deepspeed_config", {})[key] = value
            names[("deepspeed_config", key)] = name
        elif name.startswith("FSDP_") and name != "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD":
            key = "fsdp_" + name[len("FSDP_"):].lower()
            key = "fsdp_transformer_layer_cls_to_wrap" if key == "fsdp_transformer_cls_to_wrap" else key
            pseudo.setdefault("fsdp_config", {})[key] = value
            names[("fsdp_config", key)] = name
        elif name.startswith("ACCELERATE_DYNAMO_"):
            key = "dynamo_" + name[len("ACCELERATE_DYNAMO_"):].lower()
            pseudo.setdefault("dynamo_config", {})[key] = value
            names[("dynamo_config", key)] = name

    def origin_for(path: tuple[str, ...]) -> Origin:
        return Origin("env", names.get(path) or names.get(path[:1], ""))

    def where(path: tuple[str, ...]) -> str:
        return f"env {names.get(path) or names.get(path[:1], '')}"

    c = _Collector(origin_for, where)
    map_parallelism_env(environ, c, names)
    if _truthy(environ.get("ACCELERATE_USE_DEEPSPEED", "")) and _truthy(environ.get("ACCELERATE_USE_FSDP", "")):
        c.out.errors.append(Problem("parallel.strategy", "FSDP and DeepSpeed are both chosen",
                                    "env ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP", "unset one of the two variables"))
    elif _truthy(environ.get("ACCELERATE_USE_DEEPSPEED", "")):
        c.set("parallel.strategy", "deepspeed", "use_deepspeed")
        names[("use_deepspeed",)] = "ACCELERATE_USE_DEEPSPEED"
    elif _truthy(environ.get("ACCELERATE_USE_FSDP", "")):
        c.set("parallel.strategy", "fsdp", "use_fsdp")
        names[("use_fsdp",)] = "ACCELERATE_USE_FSDP"
    ds = pseudo.pop("deepspeed_config", {})
    fsdp = pseudo.pop("fsdp_config", {})
    _map_top_level(pseudo, c)
    if ds:
        _map_accelerate_deepspeed(ds, c, Path.cwd(), "env", {})
    if fsdp:
        fsdp.setdefault("fsdp_version", fsdp.get("fsdp_version", "2"))
        _map_fsdp(fsdp, c)
    _map_dynamo(pseudo.pop("dynamo_config", {}), c, legacy=False)
    return c.out
