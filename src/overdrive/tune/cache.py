"""Tuning results cached by a fingerprint of everything that decides them.

The fingerprint covers the machine (CPU model, cores, RAM, GPUs), the library versions,
the model, the sequence length and global batch, the rest of the run config that changes
speed, the search space and the search settings. Keys that cannot change speed (learning
rate, schedule, seed, logging, checkpoints, output and cache directories) are left out, so
changing them does not throw a measurement away. Computing it imports neither torch nor
matplotlib: a second `overdrive tune` on the same inputs answers at once.

Entries live in `<data.cache_dir>/tune/<fingerprint>.json`, the chart beside them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from overdrive.system import report as environment
from overdrive.config.schema import RunConfig
from overdrive.system.hardware import cpu_model
from overdrive.storage.whole_file import replace_whole

FORMAT = 1
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "tokenizers", "overdrive")
# Sections and keys that do not change how fast a step runs.
_IGNORED = {
    "output_dir": None, "logging": None, "checkpoint": None, "scheduler": None, "sweep": None,
    "optim": ("lr", "weight_decay", "betas", "eps"),
    "training": ("seed", "eval_every_steps", "eval_batches", "log_every_steps", "nonfinite_loss",
                 "max_nonfinite_in_a_row"),
    "data": ("cache_dir", "validation_fraction", "validation_split"),
    "launch": ("main_process_ip", "main_process_port", "rdzv_id", "monitor_interval", "max_restarts",
               "machine_rank", "same_network", "main_training_function"),
}


def versions() -> dict[str, Optional[str]]:
    return environment.versions(PACKAGES)


def machine() -> dict[str, Any]:
    from overdrive.system import hardware
    hw = hardware.detect(light=True)
    return {"cpu": cpu_model(), "cores": hw.cpu_cores, "ram_gib": round(hw.ram_bytes / 2**30),
            "gpus": [[g.name, round(g.memory_bytes / 2**30)] for g in hw.gpus]}


def relevant_config(cfg: RunConfig) -> dict[str, Any]:
    data = cfg.model_dump(mode="json")
    for section, keys in _IGNORED.items():
        if keys is None:
            data.pop(section, None)
        else:
            for key in keys:
                data[section].pop(key, None)
    return data


def inputs(cfg: RunConfig, space: dict[str, Any], plan: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "machine": machine(), "versions": versions(), "config": relevant_config(cfg),
            "seq_len": cfg.data.max_length, "space": space, "plan": plan, "search": settings}


def fingerprint(values: dict[str, Any]) -> str:
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def directory(cfg: RunConfig) -> Path:
    return Path(cfg.data.cache_dir).expanduser() / "tune"


def load(cfg: RunConfig, key: str) -> Optional[dict[str, Any]]:
    path = directory(cfg) / f"{key}.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("fingerprint") == key else None


def chart_path(cfg: RunConfig, key: str) -> Path:
    return directory(cfg) / f"{key}.png"


def store(cfg: RunConfig, key: str, result: dict[str, Any]) -> Path:
    path = directory(cfg) / f"{key}.json"
    return replace_whole(path, json.dumps(result, indent=1))  # a concurrent reader never sees half an entry
