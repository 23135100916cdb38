"""A plain Accelerate training loop that takes its configuration from overdrive.

Everything about *how* to run (precision, accumulation, DDP / DeepSpeed / FSDP, processes)
comes from one run config; the loop itself is the ordinary Accelerate loop.

    python examples/train_distributed.py                       # the embedded default job, into runs/train-distributed
    python examples/train_distributed.py run.yaml lr=3e-4      # files and key=value overrides
    overdrive launch -c run.yaml examples/train_distributed.py run.yaml  # several processes

(overdrive's `-c` goes before the script; what follows the script is the script's own argv.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import get_scheduler

from overdrive import build_accelerator

from overdrive import RunConfig, load_config
from overdrive.data import eval_loader, prepare, train_loader
from overdrive.training.build.model import build_model
from overdrive.training.build.tokenizer import build_tokenizer


# Where the model goes when neither a file nor an item says: `overdrive train`'s runs/default is its own run's.
OUTPUT_DIR = "runs/train-distributed"


def main(argv: list[str]) -> int:
    # 1. The run config (files, then key=value items) and an Accelerator built from it alone.
    files, items = [a for a in argv if "=" not in a], [a for a in argv if "=" in a]
    cfg = load_config(*files, cli=items)
    told = any(a.startswith("output_dir=") for a in items)
    if cfg.output_dir == RunConfig.model_fields["output_dir"].default and not told:
        cfg = load_config(*files, cli=[*items, f"output_dir={OUTPUT_DIR}"])
    accelerator = build_accelerator(cfg)
    t = cfg.training

    # 2. Data and tokenizer: one process per machine fills the caches, the others wait for them.
    tokenizer, tokens = prepare(cfg, build_tokenizer, build=accelerator.is_local_main_process,
                                show=accelerator.is_main_process)

    # 3. DataLoaders, model, optimizer.
    train_dl = train_loader(tokens.train, t.micro_batch_size, t.gradient_accumulation_steps,
                            accelerator.num_processes, seed=t.seed)
    eval_dl = eval_loader(tokens.validation, t.micro_batch_size) if tokens.validation is not None else None
    model = build_model(cfg, vocab_size=len(tokenizer), special_tokens={"eos_token_id": tokenizer.eos_token_id})
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)

    # 4. Prepare: Accelerate wraps them as the config says (DDP, ZeRO, FSDP, mixed precision).
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    # Counted in optimizer steps and stepped only when the optimizer steps (not per micro-batch).
    schedule = {"constant": "constant_with_warmup"}.get(cfg.scheduler.name, cfg.scheduler.name)
    lr_scheduler = get_scheduler(schedule, optimizer=optimizer, num_warmup_steps=cfg.scheduler.warmup_steps,
                                 num_training_steps=t.max_steps)

    # 5. The loop.
    step = 0
    model.train()
    while step < t.max_steps:
        for batch in train_dl:
            with accelerator.accumulate(model):  # handles gradient accumulation (and no_sync)
                loss = model(**batch).loss
                accelerator.backward(loss)  # loss scaling, DeepSpeed's backward, ...
                if accelerator.sync_gradients and t.gradient_clipping:
                    accelerator.clip_grad_norm_(model.parameters(), t.gradient_clipping)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                lr_scheduler.step()
                step += 1
                if step % t.log_every_steps == 0 or step == t.max_steps:
                    accelerator.print(f"step {step} loss {loss.item():.4f}")
                if step == t.max_steps:
                    break

    # 6. Evaluate, then save the unwrapped model from the main process.
    if eval_dl is not None:
        model.eval()
        losses = []
        with torch.no_grad():
            for batch in eval_dl:
                losses.append(accelerator.gather_for_metrics(model(**batch).loss.reshape(1)))
        accelerator.print(f"eval loss {torch.cat(losses).mean().item():.4f}")
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        target = Path(cfg.output_dir) / "model"
        accelerator.unwrap_model(model).save_pretrained(target, state_dict=state_dict, save_function=accelerator.save)
        tokenizer.save_pretrained(target)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
