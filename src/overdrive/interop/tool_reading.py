"""Training configs of other fine-tuning tools read as config layers: Axolotl (axolotl.py),
LLaMA-Factory (llamafactory.py) and torchtune (torchtune.py), recognised by their keys before
the Accelerate and DeepSpeed files are (an Axolotl file has an `fsdp_config`, a torchtune one an
`optimizer` block). The FSDP block and the DeepSpeed JSON such a file names are read by the
Accelerate and DeepSpeed readers, as if they came in their own files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from overdrive.config.sources import LoadedFile, load_file
from overdrive.interop import axolotl, llamafactory, torchtune
from overdrive.interop import reading
from overdrive.interop.tables import FSDP_KEYS
from overdrive.interop.tool_common import Blocks

TOOLS = {"axolotl": axolotl, "llamafactory": llamafactory, "torchtune": torchtune}


# Keys one tool writes and the others do not: a file holding two tools' keys is refused, never read
# as one of them with the other's keys set aside as "no counterpart".
OWN_KEYS = {
    "axolotl": {"base_model", "datasets", "sequence_len", "sample_packing", "lora_r", "lora_target_linear",
                "pretraining_dataset", "val_set_size", "lora_model_dir"},
    "llamafactory": {"model_name_or_path", "finetuning_type", "cutoff_len", "lora_rank", "lora_target",
                     "dataset_dir", "quantization_bit", "stage"},
}


def _tools_in(data: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each tool whose own keys the file holds, with those keys (torchtune: its _component_ blocks)."""
    found = {kind: sorted(keys & set(data)) for kind, keys in OWN_KEYS.items()}
    found["torchtune"] = sorted(k for k, v in data.items() if isinstance(v, Mapping) and "_component_" in v)
    return {kind: keys for kind, keys in found.items() if keys}


def _mixed(loaded: LoadedFile, kind: str, c) -> bool:
    """A file of `kind` that also holds another tool's own keys: refused by the first of them."""
    others = {k: keys for k, keys in _tools_in(loaded.data).items() if k != kind}
    if not others:
        return False
    mine = _tools_in(loaded.data).get(kind, [])
    for other, keys in others.items():
        c.error((keys[0],), f"this file holds keys of two tools: {TOOLS[kind].TOOL} ({', '.join(mine[:4]) or kind}) "
                f"and {TOOLS[other].TOOL} ({', '.join(keys[:4])}); overdrive will not guess which one it is",
                f"keep one tool's keys: the {TOOLS[kind].TOOL} ones or the {TOOLS[other].TOOL} ones")
    return True


def detect_kind(data: Mapping[str, Any]) -> str:
    """`axolotl`, `llamafactory`, `torchtune`, else what interop/reading.detect_kind says."""
    for kind, module in TOOLS.items():
        if module.recognises(data):
            return kind
    return reading.detect_kind(data)


def map_file(loaded: LoadedFile, kind: str, layer: str):
    if kind not in TOOLS:
        return reading.map_file(loaded, kind, layer)

    def origin_for(path: tuple[str, ...]):
        return reading.Origin(layer, str(loaded.path), loaded.line(*path) or None)

    collector = reading._Collector(origin_for, lambda path: loaded.where(*path), native=kind)
    if _mixed(loaded, kind, collector):
        return collector.out
    try:
        blocks = TOOLS[kind].read(loaded.data, collector, str(loaded.path))
    except (ValueError, TypeError, AttributeError) as error:  # a value of another type than the tool's
        key = getattr(collector, "reading", ())
        value = loaded.data.get(key[0]) if key else None
        collector.error(key, f"{value!r} is not a value {TOOLS[kind].TOOL} accepts here ({error})",
                        f"give {'.'.join(key) or 'the key'} a value of the type {TOOLS[kind].TOOL} documents")
        return collector.out
    _fsdp(blocks, collector)
    _deepspeed(blocks, collector, loaded, layer)
    return collector.out


def _fsdp(blocks: Blocks, c) -> None:
    if blocks.fsdp is None:
        return
    paths = blocks.fsdp_paths
    inner = reading._Collector(lambda p: c.origin_for(paths.get(p[-1], p)), lambda p: c.where(paths.get(p[-1], p)),
                               native=c.native)
    known = {k: v for k, v in blocks.fsdp.items() if k in FSDP_KEYS}
    for key in sorted(set(blocks.fsdp) - set(known)):  # FSDP1 settings Accelerate's config does not carry
        c.warn(paths.get(key, ("fsdp_config", key)), "FSDP key with no counterpart in overdrive: not used")
    reading._map_fsdp(known, inner)
    c.out.extend(inner.out)
    c.set("parallel.strategy", "fsdp", *(paths.get("fsdp_version") or next(iter(paths.values()), ("fsdp",))))


def _deepspeed(blocks: Blocks, c, loaded: LoadedFile, layer: str) -> None:
    if blocks.deepspeed is None:
        return
    given, path = blocks.deepspeed
    if isinstance(given, Mapping):  # an inline DeepSpeed dict (LLaMA-Factory, torchtune may pass one)
        lines = {key[len(path):]: line for key, line in loaded.lines.items() if key[:len(path)] == path}
        c.out.extend(reading.map_file(LoadedFile(loaded.path, dict(given), lines), "deepspeed", layer))
        return
    # The tools resolve the path against the working directory; the file's folder is tried too.
    candidates = [Path(given).expanduser(), Path(os.path.normpath(loaded.path.parent / given))]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        stage = next((s for s in (3, 2, 1) if f"zero{s}" in str(given).replace("_", "").lower()
                      or f"z{s}" in Path(str(given)).stem.lower()), None)
        c.warn(path, f"DeepSpeed config {given} not found (looked in the working directory and beside the file): "
               f"its values are not read" + (f"; ZeRO stage {stage} taken from its name" if stage else ""),
               "copy it beside the config, or pass it as one more file: overdrive import run.yaml ds.json")
        c.set("parallel.strategy", "deepspeed", *path)
        if stage:
            c.set("parallel.deepspeed.zero_stage", stage, *path)
        return
    ds = load_file(found, "DeepSpeed config file")
    c.out.extend(reading.map_file(ds, "deepspeed", layer))

