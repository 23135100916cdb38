"""An ordinary Transformers Trainer script: nothing in it knows about overdrive.

    python examples/train_trainer.py --model MODEL_DIR --data train.jsonl
    overdrive launch -c run.yaml examples/train_trainer.py --model MODEL_DIR --data train.jsonl

Under `overdrive launch` the Trainer's own Accelerator gets the configured strategy (DDP,
DeepSpeed ZeRO, FSDP2), processes, mixed precision and accumulation, and the configured
optimizer and schedule values reach its TrainingArguments; where this script sets a value
the config also sets (try `--gradient-accumulation-steps 1`), rank 0 says so before the
first step (docs/scripts.md has the rule).

With `--overdrive-config run.yaml` the script instead builds every TrainingArguments value
from the config itself, with `overdrive.hf.training_arguments(cfg)`.

MODEL_DIR is any causal LM saved with `save_pretrained` (with its tokenizer); the data is a
JSON-lines file with a "text" field. `--report OUT.json` makes rank 0 write what the
Trainer's accelerator was configured with and what the training did.
"""

from __future__ import annotations

import argparse
import json

import torch
from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a causal LM directory written by save_pretrained")
    parser.add_argument("--data", required=True, help='JSON lines with a "text" field')
    parser.add_argument("--output-dir", default="trainer_output")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, help="TrainingArguments' default (1) if not given")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--overdrive-config", metavar="FILE",
                        help="take every TrainingArguments value from this overdrive config instead")
    parser.add_argument("--report", metavar="OUT.json", help="rank 0 writes the accelerator's settings and the run's")
    return parser.parse_args()


def arguments(args: argparse.Namespace) -> TrainingArguments:
    if args.overdrive_config:
        from overdrive import load_config
        from overdrive.hf import training_arguments

        return training_arguments(load_config(args.overdrive_config), report_to="none", disable_tqdm=True)
    own = {"gradient_accumulation_steps": args.gradient_accumulation_steps} if args.gradient_accumulation_steps else {}
    return TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=1e-3,
                             per_device_train_batch_size=args.batch_size, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=True, **own)


class CountForwards:
    """Micro-batches this rank ran forward in training: optimizer steps x accumulation."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        model.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, inputs: object) -> None:
        if module.training:
            self.count += 1


def main() -> None:
    args = parse()
    training_args = arguments(args)  # before the model: ZeRO-3 may build it already sharded
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    forwards = CountForwards(model)
    with training_args.main_process_first():
        data = load_dataset("json", data_files=args.data, split="train")
        data = data.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=args.max_length),
                        batched=True, remove_columns=data.column_names)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, processing_class=tokenizer,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()

    accelerator = trainer.accelerator
    plugin = accelerator.state.deepspeed_plugin
    report = {
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "zero_stage": plugin.zero_stage if plugin else None,
        "ds_bf16": plugin.deepspeed_config["bf16"]["enabled"] if plugin else None,
        "ds_gradient_accumulation_steps": plugin.deepspeed_config["gradient_accumulation_steps"] if plugin else None,
        "fsdp_version": getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
        "args": {name: getattr(trainer.args, name) for name in (
            "gradient_accumulation_steps", "per_device_train_batch_size", "learning_rate", "max_steps", "bf16",
            "max_grad_norm", "seed", "warmup_steps", "weight_decay", "adam_beta2", "output_dir")},
        "lr_scheduler_type": str(trainer.args.lr_scheduler_type.value),
        "global_step": trainer.state.global_step,
        "forwards": forwards.count,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "learning_rates": [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry],
    }
    if args.report and trainer.is_world_process_zero():
        with open(args.report, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
