"""A plain Accelerate script that checkpoints and resumes on its own, as users write them.

Run by `overdrive launch tests/resumable_script_probe.py OUT STEPS`: trains a tiny GPT-2 on
random tokens for STEPS optimizer steps, saves `accelerator.save_state` every 3 steps into
OUT/checkpoints/step-N (written under a temporary name, renamed when complete), resumes from
the newest complete one, and rank 0 appends every step to OUT/steps.jsonl. No signal handler:
a SIGTERM ends it, as it ends most scripts.
"""

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

out, steps = Path(sys.argv[1]), int(sys.argv[2])
checkpoints = out / "checkpoints"
accelerator = Accelerator()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randint(0, 128, (4096, 32), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

done = sorted(int(p.name[5:]) for p in checkpoints.glob("step-*")) if checkpoints.is_dir() else []
start = done[-1] if done else 0
if start:
    accelerator.load_state(str(checkpoints / f"step-{start}"))
    accelerator.print(f"resumed from step {start}")
batches = iter(accelerator.skip_first_batches(loader, start) if start else loader)
for step in range(start + 1, steps + 1):
    batch = next(batches)
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if accelerator.is_main_process:
        with (out / "steps.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item(), "time": time.time()}) + "\n")
    if step % 3 == 0:
        partial = checkpoints / f".partial-{step}"
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            partial.rename(checkpoints / f"step-{step}")
        accelerator.wait_for_everyone()
