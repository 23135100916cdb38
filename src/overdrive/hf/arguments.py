"""The run config as Transformers' TrainingArguments, and its `peft:` section as PEFT's LoraConfig."""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig

def training_arguments_kwargs(cfg: RunConfig, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments `training_arguments` passes to TrainingArguments."""
    from overdrive.hf.fields import values

    kwargs = {field.name: value for field, value in values(cfg)}
    kwargs.update(overrides)
    return kwargs


def training_arguments(cfg: RunConfig, cls: Any = None, **overrides: Any) -> Any:
    """A `TrainingArguments` (or `cls`, e.g. TRL's `SFTConfig`) built from the resolved config.

    `overrides` are TrainingArguments fields and win over the config (for what the config has
    no key for: `report_to`, `eval_strategy`, ...). The micro-batch is left to the
    TrainingArguments default when the config's is `auto`.
    """
    if cls is None:
        from transformers import TrainingArguments as cls

    return cls(**training_arguments_kwargs(cfg, **overrides))


def peft_config(cfg: RunConfig) -> Any:
    """PEFT's LoraConfig for the run's `peft:` section, or None without an adapter. A qlora base
    also needs `quantization_config=overdrive.training.build.adapter.quantization(cfg)` at load time."""
    if cfg.peft.method == "none":
        return None
    from overdrive.hf.lora import lora_config

    return lora_config(cfg.peft, cfg.model.task)
