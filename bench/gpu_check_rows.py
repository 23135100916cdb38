"""The rows of bench/gpu_check.py: each runs overdrive as a user types it and judges what the
run wrote (metrics.jsonl, `plan --json`, `profile --json`). A row returns (passed, detail)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
QUIET = ["logging.trackers=[none]", "logging.progress=false", "checkpoint.enabled=false",
         "checkpoint.save_final_model=false", "training.eval_every_steps=null", "data.validation_fraction=0"]
PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s", "sync_s", "checkpoint_s", "eval_s")
# A 134M-parameter Llama (untied 32k embeddings) and the shape of a 1B one, built from the config
# with fresh weights: no download.
LLAMA_134M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 2048}
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 2048}


@dataclass
class Context:
    work: Path
    gpu: bool

    @property
    def cache(self) -> str:
        return f"data.cache_dir={self.work / 'cache'}"

    def device(self) -> list[str]:
        return [] if self.gpu else ["launch.use_cpu=true"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


def overdrive(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overdrive.cli", *argv], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=timeout)


def train(ctx: Context, name: str, *items: str, timeout: float = 600) -> list[dict]:
    """The run's metrics records with a loss; raises with the run's last words when it failed."""
    out = ctx.work / name
    done = overdrive("train", *QUIET, ctx.cache, *ctx.device(), *items, f"output_dir={out}", timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def architecture(shape: dict) -> list[str]:
    return [f"model.architecture={json.dumps(shape)}", "tokenizer.vocab_size=32000", "data.max_bytes=8000000"]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


# Units in the last place of each training precision (torch.finfo(dtype).eps): two runs of the same
# math in that precision, summed in another order (a sharded all-reduce against one process), part
# by a few of them per step, and the parting grows with the steps like a random walk.
EPS = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10, "no": 2.0 ** -23}
ULPS = 4  # per step; a defect (an adapter left untrained, another model, a lost gradient) parts by far more


def within_precision(a: list[float], b: list[float], precision: str) -> tuple[bool, float, float]:
    """(within, the largest parting as a share of its bar, the largest |difference|) of two loss
    curves that should be one: step i may part by ULPS x eps(precision) x |loss| x sqrt(i)."""
    if not a or len(a) != len(b):
        return False, math.inf, math.inf
    eps = max(EPS[precision], 1e-6)  # fp32 runs still differ by summation order: a floor
    shares = [abs(x - y) / (ULPS * eps * max(abs(x), abs(y), 1e-3) * math.sqrt(i))
              for i, (x, y) in enumerate(zip(a, b), 1)]
    return max(shares) <= 1.0, max(shares), max(abs(x - y) for x, y in zip(a, b))


# ------------------------------------------------------------------ the rows


def qlora(ctx: Context) -> tuple[bool, str]:
    from hf_fixtures import make_chat_data, make_tiny_llama

    base, chat = ctx.work / "llama", ctx.work / "chat.jsonl"
    if not base.exists():
        # 64 wide at least: bitsandbytes' CPU path quantizes rows in blocks of 64 values.
        make_tiny_llama(base, hidden_size=256 if ctx.gpu else 64)
        make_chat_data(chat, rows=200)
    run = [f"model.name_or_path={base}", f"data.source={chat}", "data.format=chat", "data.max_length=64",
           "peft.r=8", "peft.alpha=16", "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0",
           "training.micro_batch_size=4", "training.log_every_steps=1", "training.max_steps=10",
           "precision.mixed_precision=bf16"]
    plain = losses(train(ctx, "qlora", *run, "peft.method=qlora"))
    fsdp = losses(train(ctx, "qlora-fsdp2", *run, "peft.method=qlora", "parallel.strategy=fsdp",
                        "launch.num_processes=1"))
    lora = losses(train(ctx, "lora", *run, "peft.method=lora"))
    within, share, apart = within_precision(fsdp, plain, "bf16")
    from_lora = max(abs(a - b) for a, b in zip(plain, lora))
    ok = len(fsdp) == len(plain) == 10 and within
    return ok, (f"FSDP2 vs plain: max |dloss| {apart:.2e} over {len(fsdp)} steps, {share:.0%} of the bf16 bar "
                f"({ULPS} x eps x |loss| x sqrt(step)); QLoRA vs LoRA: {from_lora:.2e}; last losses "
                f"{fsdp[-1]:.3f} / {plain[-1]:.3f} / {lora[-1]:.3f}")


def fp16_weights(ctx: Context) -> tuple[bool, str]:
    got = train(ctx, "fp16-weights", "model.dtype=float16", "precision.mixed_precision=fp16",
                "training.max_steps=20", "training.log_every_steps=1")
    finite = all(math.isfinite(x) for x in losses(got))
    return len(got) == 20 and finite, f"{len(got)} steps, losses {got[0]['loss']:.3f} -> {got[-1]['loss']:.3f}"


def fp16_overflow(ctx: Context) -> tuple[bool, str]:
    """The loss scale starts at 2**24 (Accelerate's GradScaler is patched in this row's own
    process): the first steps overflow and are skipped until the scale is small enough."""
    out = ctx.work / "fp16-overflow"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--child", "overflow", "train",
                           *QUIET, ctx.cache, "precision.mixed_precision=fp16", "training.max_steps=20",
                           "training.log_every_steps=1", "scheduler.name=linear", "scheduler.warmup_steps=10",
                           "optim.implementation=fused", f"output_dir={out}"],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-500:])
    got = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    skips = sum(r.get("loss_scale_skips", 0) for r in got)
    # Warmup from 0: while steps are skipped the schedule stays where it was, so the first
    # step after the skips uses the same lr as step 1.
    held = skips > 0 and len(got) > skips and got[skips]["lr"] == got[0]["lr"] and got[skips + 1]["lr"] > got[0]["lr"]
    return held, f"{skips} steps skipped by the scaler; lr at steps 1, {skips + 1}, {skips + 2}: " \
                 f"{got[0]['lr']:.2e}, {got[min(skips, len(got) - 1)]['lr']:.2e}, {got[min(skips + 1, len(got) - 1)]['lr']:.2e}"


STRATEGIES = {"one process": [], "ZeRO-2": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"],
              "ZeRO-3": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"],
              "FSDP2": ["parallel.strategy=fsdp"]}


def memory(ctx: Context) -> tuple[bool, str]:
    job = [*architecture(LLAMA_134M), "precision.mixed_precision=bf16", "training.micro_batch_size=4",
           "data.max_length=512", "training.max_steps=5", "training.log_every_steps=1", "launch.num_processes=1"]
    ratios = {}
    for name, items in STRATEGIES.items():
        planned = overdrive("plan", *job, *items, ctx.cache, "--json")
        if planned.returncode != 0:
            raise RuntimeError(f"plan {name}: {planned.stderr[-400:]}")
        estimate = json.loads(planned.stdout)["memory"]["total_bytes"]
        got = train(ctx, f"memory-{name.replace(' ', '-')}", *job, *items)
        ratios[name] = max(r["peak_memory_mb"] for r in got) * 2**20 / estimate
    ok = all(0.7 <= r <= 1.3 for r in ratios.values())
    return ok, "measured / estimate: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + " (bar 0.7..1.3)"


def mfu(ctx: Context) -> tuple[bool, str]:
    default = train(ctx, "mfu-default", "precision.mixed_precision=bf16", "training.max_steps=30",
                    "training.log_every_steps=10")
    big = train(ctx, "mfu-1b", *architecture(LLAMA_1B), "precision.mixed_precision=bf16", "model.dtype=float32",
                "training.micro_batch_size=4", "data.max_length=1024", "training.max_steps=15",
                "training.log_every_steps=5")
    small, large = default[-1]["mfu"], big[-1]["mfu"]
    ok = small is not None and large is not None and 0.0 < small < 1.0 and 0.1 < large < 0.9
    return ok, f"default job {small:.1%}, 1B Llama shape (bf16, 4 x 1024 tokens) {large:.1%}"


def phases(ctx: Context) -> tuple[bool, str]:
    got = train(ctx, "phases", "training.max_steps=10", "training.log_every_steps=1", "data.max_bytes=2000000",
                "tokenizer.train_max_bytes=2000000")
    ratios = [sum(r[p] for p in PHASES) / (r["elapsed_s"] - before["elapsed_s"])
              for before, r in zip(got[2:], got[3:])]
    ratio = statistics.median(ratios)
    return abs(ratio - 1) <= 0.05, f"sum of phases / step time: median {ratio:.3f} over {len(ratios)} steps (bar 5%)"


def profile(ctx: Context) -> tuple[bool, str]:
    done = overdrive("profile", *QUIET, ctx.cache, *architecture(LLAMA_134M), "precision.mixed_precision=bf16",
                     "training.micro_batch_size=8", "data.max_length=1024", f"output_dir={ctx.work / 'profile'}",
                     "--json", "--steps", "5", "--warmup", "3")
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-500:])
    report = json.loads(done.stdout)
    return report["bottleneck"] == "compute", f"bottleneck: {report['bottleneck']} (expected compute)"


def compile_row(ctx: Context) -> tuple[bool, str]:
    job = ["precision.mixed_precision=bf16", "training.max_steps=40", "training.log_every_steps=10"]
    eager = train(ctx, "eager", *job)
    compiled = train(ctx, "compiled", *job, "compile.backend=inductor")
    apart = max(abs(a - b) for a, b in zip(losses(eager), losses(compiled)))
    speed = compiled[-1]["tokens_per_s"] / eager[-1]["tokens_per_s"]
    return apart <= 5e-2, f"tokens/s compiled / eager {speed:.2f}; max |dloss| {apart:.2e} (bar 5e-2)"


def vllm_row(ctx: Context) -> tuple[bool, str]:
    """GRPO under LoRA on a tiny Llama (tests/hf_fixtures.py), 4 steps generating with vLLM colocated (sleep mode on)
    against overdrive's own sampler: both train, and the seconds a step spends generating."""
    from overdrive.training.generation import vllm_sampling

    if not vllm_sampling.installed():
        raise RuntimeError("vllm is not installed: pip install 'overdrive[vllm]'")
    from hf_fixtures import make_tiny_llama

    base = make_tiny_llama(ctx.work / "vllm-base", hidden_size=256)  # head size 64: vLLM's attention kernels take it
    prompts = ctx.work / "vllm-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "no") * 16))
    job = [f"model.name_or_path={base}", f"data.source={prompts}", "data.format=prompts", "data.max_length=64",
           "rl.method=grpo", "rl.num_generations=8", "rl.max_completion_length=16", "peft.method=lora",
           "rl.reward_funcs=[{function: exact_match, column: answer}]", "training.micro_batch_size=16",
           "training.max_steps=4", "training.log_every_steps=1", "precision.mixed_precision=bf16"]
    own = train(ctx, "grpo-own", *job)
    fast = train(ctx, "grpo-vllm", *job, "rl.use_vllm=true", "rl.vllm_gpu_memory_utilization=0.2",
                 "rl.vllm_enable_sleep_mode=true")
    ok = len(fast) == 4 and all(math.isfinite(r["loss"]) and r["completions/mean_length"] > 0 for r in fast)
    gen = [statistics.median(r["timing/generation_s"] for r in rs[1:]) for rs in (own, fast)]
    return ok, (f"generation s/step (median of steps 2-4): own sampler {gen[0]:.3f}, vLLM colocated {gen[1]:.3f}; "
                f"reward step 4: own {own[-1]['reward']:.2f}, vLLM {fast[-1]['reward']:.2f}")


# name: (needs a GPU, the check)
ROWS: dict[str, tuple[bool, Callable[[Context], tuple[bool, str]]]] = {
    "qlora": (False, qlora), "fp16_weights": (True, fp16_weights), "fp16_overflow": (True, fp16_overflow),
    "memory": (True, memory), "mfu": (True, mfu), "phases": (False, phases), "profile": (True, profile),
    "compile": (True, compile_row), "vllm": (True, vllm_row),
}


def child(name: str, argv: list[str]) -> int:
    """A row's run inside this interpreter, with what the row changes in the libraries."""
    if name != "overflow":
        raise SystemExit(f"unknown child {name}")
    import torch

    original = torch.amp.GradScaler.__init__

    def huge_initial_scale(self, *args, **kwargs):
        kwargs["init_scale"] = 2.0**24
        original(self, *args, **kwargs)

    torch.amp.GradScaler.__init__ = huge_initial_scale
    from overdrive.cli import main

    return main(argv)
