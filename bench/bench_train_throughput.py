"""Training throughput: overdrive's loop against a minimal Accelerate loop and the Trainer.

One run measures all three on the same model (same config and seed, so the same initial
weights), the same data (overdrive's packed standard-library blocks), the same batch shape,
optimizer (fused AdamW) and precision. Each is timed in steady state: from the end of
optimizer step `--warmup` to the end of step `--steps`, after a sync, so start-up, data
loading and the first slow steps are not counted. The three run interleaved for `--repeats`
rounds, in an order that rotates every round (other processes on a shared machine slow
whichever happens to be running); the table reports the median and the best.

    python bench/bench_train_throughput.py                 # writes bench/results/train_throughput.md
    python bench/bench_train_throughput.py --precision bf16 --repeats 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from overdrive import data as data_mod
from overdrive.training import loop as trainer
from overdrive.config.schema import RunConfig
from overdrive.training.build.model import build_model
from overdrive.training.build.tokenizer import build_tokenizer

HERE = Path(__file__).resolve().parent
TARGET = 0.98  # overdrive's median tokens/s over the hand-written loop's, at least; exit 1 below


def bench_config(args, out: Path) -> RunConfig:
    return RunConfig.model_validate({
        "data": {"cache_dir": args.cache_dir, "max_length": args.seq_len, "validation_fraction": 0.0,
                 "max_bytes": 4_000_000},
        "training": {"micro_batch_size": args.micro_batch, "max_steps": args.steps, "log_every_steps": args.warmup,
                     "eval_every_steps": None},
        "precision": {"mixed_precision": args.precision},
        "checkpoint": {"save_final_model": False},
        "logging": {"trackers": ["none"], "progress": False, "level": "quiet"},
        "output_dir": str(out),
    })


def shared_inputs(cfg: RunConfig):
    """The tokenizer and packed blocks all three loops train on (from overdrive's caches)."""
    tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer)
    return tokenizer, tokens.train


def fresh_model(cfg: RunConfig, tokenizer):
    from accelerate.utils import set_seed

    set_seed(cfg.training.seed)
    return build_model(cfg, vocab_size=len(tokenizer), special_tokens={"eos_token_id": tokenizer.eos_token_id})


def run_overdrive(cfg: RunConfig, args) -> float:
    trainer.train(cfg)
    from overdrive.training import metrics

    logged = metrics.read(metrics.path_in(cfg.output_dir)).records
    start = next(r for r in logged if r["step"] == args.warmup)
    end = next(r for r in logged if r["step"] == args.steps)
    return (end["tokens"] - start["tokens"]) / (end["time"] - start["time"])


def run_accelerate(cfg: RunConfig, args, tokenizer, dataset) -> float:
    """The minimal hand-written loop: what a user would write with Accelerate alone."""
    from accelerate import Accelerator
    from transformers import get_scheduler

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.precision)
    model = fresh_model(cfg, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=cfg.scheduler.warmup_steps,
                              num_training_steps=args.steps)
    model.train()
    step, tokens, start = 0, 0, None
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == args.warmup:
                loss.item()  # sync, as overdrive does at its logging steps
                start = time.time()
            elif step > args.warmup:
                tokens += batch["input_ids"].numel()
            if step == args.steps:
                loss.item()
                break
    return tokens / (time.time() - start)


def run_trainer(cfg: RunConfig, args, tokenizer, dataset, out: Path) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    marks: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in (args.warmup, args.steps):
                marks[state.global_step] = time.time()

    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
        learning_rate=cfg.optim.lr, warmup_steps=cfg.scheduler.warmup_steps, lr_scheduler_type="cosine",
        weight_decay=cfg.optim.weight_decay, max_grad_norm=1.0, optim="adamw_torch_fused",
        bf16=args.precision == "bf16", use_cpu=not torch.cuda.is_available(), logging_steps=args.warmup,
        save_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True, seed=cfg.training.seed)
    Trainer(model=fresh_model(cfg, tokenizer), args=targs, train_dataset=dataset, callbacks=[Clock()]).train()
    steady_tokens = (args.steps - args.warmup) * args.micro_batch * args.seq_len
    return steady_tokens / (marks[args.steps] - marks[args.warmup])


def reset_accelerate() -> None:
    """Accelerate's state is a process-wide singleton; each loop starts from scratch."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed")
    parser.add_argument("--repeats", type=int, default=6, help="a multiple of 3 puts each loop in each position equally")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--cache-dir", default="~/.cache/overdrive")
    parser.add_argument("--out", default=str(HERE / "results" / "train_throughput.md"))
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    cfg = bench_config(args, work / "overdrive")
    tokenizer, dataset = shared_inputs(cfg)
    results: dict[str, list[float]] = {"overdrive": [], "accelerate (hand-written)": [], "transformers Trainer": []}
    names = list(results)
    for round_ in range(-args.warmup_rounds, args.repeats):
        # The order rotates every round: whichever runs right after another loop inherits its
        # warm allocator and caches, and that must not favour one loop throughout.
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            out = work / f"{round_}-{name.split()[0]}"
            cfg = bench_config(args, out)
            if name == "overdrive":
                rate = run_overdrive(cfg, args)
            elif name.startswith("accelerate"):
                rate = run_accelerate(cfg, args, tokenizer, dataset)
            else:
                rate = run_trainer(cfg, args, tokenizer, dataset, out)
            reset_accelerate()
            if round_ >= 0:  # warm-up rounds pay for first-use costs (allocator, kernels, page cache)
                results[name].append(rate)
            print(f"round {round_ + 1}: {name:28s} {rate:10,.0f} tokens/s", flush=True)

    ratio = write_table(args, cfg, tokenizer, results)
    return 0 if ratio >= TARGET else 1


def write_table(args, cfg: RunConfig, tokenizer, results: dict[str, list[float]]) -> float:
    """Writes the table; returns overdrive's median tokens/s over the hand-written loop's."""
    from overdrive.training.build.model import flop_params

    n_params = flop_params(build_model(cfg, vocab_size=len(tokenizer), device="meta"))
    base = statistics.median(results["accelerate (hand-written)"])
    best_base = max(results["accelerate (hand-written)"])
    arch = cfg.model.architecture
    lines = [
        "# Training throughput: overdrive vs a hand-written Accelerate loop vs the Trainer",
        "",
        f"Model: {arch.get('model_type')} n_layer={arch.get('n_layer')} n_embd={arch.get('n_embd')} "
        f"vocab={len(tokenizer)} ({n_params / 1e6:.2f}M matmul parameters); micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens; precision `{args.precision}`; fused AdamW; data: packed standard-library blocks.",
        f"Steady state: steps {args.warmup}..{args.steps}; {args.repeats} interleaved rounds (order rotating) after "
        f"{args.warmup_rounds} uncounted warm-up round(s).",
        f"Machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
        f"torch {torch.__version__}, {'CUDA' if torch.cuda.is_available() else 'CPU only'}.",
        "",
        "| loop | median tokens/s | best tokens/s | median ratio to hand-written | best ratio | all rounds |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, rates in results.items():
        median = statistics.median(rates)
        lines.append(f"| {name} | {median:,.0f} | {max(rates):,.0f} | {median / base:.3f} | "
                     f"{max(rates) / best_base:.3f} | {', '.join(f'{r:,.0f}' for r in rates)} |")
    ratio = statistics.median(results["overdrive"]) / base
    lines += ["", f"overdrive / hand-written Accelerate, median: **{ratio:.3f}** (target >= {TARGET}: "
              f"{'met' if ratio >= TARGET else 'NOT met'}).",
              "", f"Written by `python bench/bench_train_throughput.py {' '.join(sys.argv[1:])}` on "
              f"{time.strftime('%Y-%m-%d %H:%M')}.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return ratio


if __name__ == "__main__":
    sys.exit(main())
