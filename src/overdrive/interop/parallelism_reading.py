"""Accelerate's `parallelism_config:` block (and the PARALLELISM_CONFIG_* variables its
launcher turns it into), read as it is onto the `parallel.*` layout keys.

Accelerate fills a size the block leaves out with 1 (ParallelismConfig's defaults); so does
this reading, so an Accelerate YAML means the same layout under overdrive as under
`accelerate launch`. Used by interop/reading.py; kept apart to keep that file small.
"""

from __future__ import annotations

from typing import Any, Mapping

from overdrive.interop.tables import PARALLELISM_BACKENDS, PARALLELISM_KEYS, PARALLELISM_PREFIX

_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def _hint(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(str(key), list(PARALLELISM_KEYS), n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


def map_parallelism(block: Mapping[str, Any], c: Any, path: tuple[str, ...] = ("parallelism_config",)) -> None:
    """Map one `parallelism_config` mapping through the collector `c` (reading._Collector)."""
    for key, value in block.items():
        target = PARALLELISM_KEYS.get(key, "?")
        if target == "?":
            c.error(path + (key,), "not a parallelism_config key" + _hint(key))
        elif key in PARALLELISM_BACKENDS:
            if value is not None and str(value).lower() != PARALLELISM_BACKENDS[key]:
                c.error(path + (key,), f"{value!r} is not a backend Accelerate has",
                        f"use {PARALLELISM_BACKENDS[key]} (the only one)")
        elif value is None or str(value) == "None":  # Accelerate's launcher writes "None" for unset
            continue
        elif target.endswith("_is_variable"):
            c.set(target, str(value).strip().lower() in ("true", "1", "yes") if isinstance(value, str) else value,
                  *path, key)
        else:
            c.set(target, value, *path, key)
    for size in _SIZES:
        if PARALLELISM_PREFIX + size not in block:
            c.set(f"parallel.{size}", 1, *path)  # Accelerate's default for a size left out


def map_parallelism_env(environ: Mapping[str, str], c: Any, names: dict[tuple[str, ...], str]) -> None:
    """The PARALLELISM_CONFIG_* variables as the block they stand for; `names` records the
    variable behind each key (for origins). Accelerate builds a ParallelismConfig from them
    only with ACCELERATE_USE_PARALLELISM_CONFIG=true: without it they are reported as ignored."""
    found = {name: PARALLELISM_PREFIX + name[len("PARALLELISM_CONFIG_"):].lower()
             for name in environ if name.startswith("PARALLELISM_CONFIG_")}
    if str(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "")).lower() != "true":
        for name in sorted(found):
            c.warn(("parallelism_config",), f"{name} ignored: Accelerate reads it only with "
                   "ACCELERATE_USE_PARALLELISM_CONFIG=true")
        return
    names.update({("parallelism_config", key): name for name, key in found.items()})
    names[("parallelism_config",)] = "ACCELERATE_USE_PARALLELISM_CONFIG"
    map_parallelism({key: environ[name] for name, key in found.items()}, c)
