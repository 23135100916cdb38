"""PEFT's LoraConfig from a run's `peft:` section: the one builder, for the model that trains
(training/build/adapter.py), the estimator's count of trainable parameters (memory/adapter.py),
`overdrive export --peft` and scripts' own `get_peft_model` or TRL's `peft_config=`; and an adapter that
exists read back (`adapter_config`: PEFT's adapter_config.json, for peft.adapter_path and `overdrive merge`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}


def lora_config(peft: Any, task: str = "causal-lm") -> Any:
    """LoraConfig for the `peft` section (PeftConfig) of a run whose model.task is `task`."""
    from peft import LoraConfig

    return LoraConfig(
        r=peft.r, lora_alpha=peft.alpha, lora_dropout=peft.dropout,
        target_modules=peft.target_modules if isinstance(peft.target_modules, str) else list(peft.target_modules),
        modules_to_save=list(peft.modules_to_save) or None, use_dora=peft.use_dora, use_rslora=peft.use_rslora,
        task_type=TASK_TYPES[task], bias="none")


def adapter_config(path: str) -> dict:
    """PEFT's adapter_config.json in `path`; ValueError naming what is wrong."""
    folder = Path(path).expanduser()
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"no adapter_config.json in {folder}" if folder.is_dir() else f"{folder} is not a directory")
    try:
        data = json.loads(config.read_text())
    except ValueError as error:
        raise ValueError(f"{config} is not JSON: {error}") from None
    if str(data.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{config}: a {data.get('peft_type')} adapter; overdrive continues LoRA adapters")
    return data
