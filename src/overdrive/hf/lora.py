"""PEFT's LoraConfig from a run's `peft:` section: the one builder, for the model that trains
(training/adapter.py), the estimator's count of trainable parameters (memory/adapter.py),
`overdrive export --peft` and scripts' own `get_peft_model` or TRL's `peft_config=`."""

from __future__ import annotations

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
