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

from overdrive.hf.arguments import peft_config, training_arguments, training_arguments_kwargs

__all__ = ["peft_config", "training_arguments", "training_arguments_kwargs"]
