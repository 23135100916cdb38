"""An ordinary TRL supervised fine-tuning script (SFTTrainer): nothing in it knows about overdrive.

    python examples/train_trl.py --model MODEL_DIR --data train.jsonl
    overdrive launch -c run.yaml examples/train_trl.py --model MODEL_DIR --data train.jsonl

SFTTrainer is a Transformers Trainer, and SFTConfig its TrainingArguments: under `overdrive
launch` they get the configured strategy, processes, precision, accumulation and optimizer
values exactly as examples/train_trainer.py does (docs/scripts.md).

MODEL_DIR is a causal LM saved with `save_pretrained` (with its tokenizer); the data is a
JSON-lines file with a "text" field. `--report OUT.json` makes rank 0 write what the
trainer's accelerator was configured with and what the training did.
"""

from __future__ import annotations

import argparse
import json

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--output-dir", default="sft_output")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--report", metavar="OUT.json")
    args = parser.parse_args()

    config = SFTConfig(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2,
                       learning_rate=1e-3, max_length=32, logging_steps=1, save_strategy="no", report_to="none",
                       disable_tqdm=True, gradient_checkpointing=False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=load_dataset("json", data_files=args.data, split="train"))
    trainer.train()

    accelerator = trainer.accelerator
    plugin = accelerator.state.deepspeed_plugin
    report = {
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "zero_stage": plugin.zero_stage if plugin else None,
        "fsdp_version": getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "global_step": trainer.state.global_step,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }
    if args.report and trainer.is_world_process_zero():
        with open(args.report, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
