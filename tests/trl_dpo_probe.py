"""TRL's own DPOTrainer on the same pairs and settings as an overdrive LoRA DPO run (its log
history written as jsonl): the reference curve the runs are compared with."""

import json
import sys

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

base, data, out, lr, steps = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
tok = AutoTokenizer.from_pretrained(base)
model = AutoModelForCausalLM.from_pretrained(base)
ds = load_dataset("json", data_files=data, split="train")
args = DPOConfig(output_dir=out, beta=0.1, learning_rate=lr, per_device_train_batch_size=8, max_steps=steps,
                 lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, max_length=64, use_cpu=True,
                 report_to="none", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
                 save_strategy="no", seed=0, optim="adamw_torch")
peft = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft)
trainer.train()
with open(out + "/trl_log.jsonl", "w") as f:
    for r in trainer.state.log_history:
        f.write(json.dumps(r) + "\n")
