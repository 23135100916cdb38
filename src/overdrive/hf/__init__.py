"""The run config as Transformers' TrainingArguments, for scripts built on the Trainer (or TRL).

    from overdrive import load_config
    from overdrive.hf import training_arguments
    cfg = load_config("run.yaml")
    args = training_arguments(cfg, report_to="none")   # overrides win over the config
    trainer = Trainer(model=model, args=args, train_dataset=train)

Every field comes from one overdrive key (hf/fields.py; `overdrive explain run.yaml
--training-arguments` lists them). Under `overdrive launch` the same table reaches a
script's own TrainingArguments, so a script may use either.

`peft_config(cfg)` is the `peft:` section as PEFT's LoraConfig (None when peft.method is
none), for `get_peft_model(model, ...)` or TRL's `SFTTrainer(peft_config=...)`.
"""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig

__all__ = ["peft_config", "training_arguments", "training_arguments_kwargs"]


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
    also needs `quantization_config=overdrive.training.adapter.quantization(cfg)` at load time."""
    if cfg.peft.method == "none":
        return None
    from overdrive.training.adapter import lora_config

    return lora_config(cfg)
