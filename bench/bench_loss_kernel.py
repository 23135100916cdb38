"""The output layer's loss without the logits: peak memory and time of one training step per
`training.loss_kernel`, activation offloading against none, and `estimate` against the measured peak.

A small Llama (2 layers, hidden 256, Llama 3's vocabulary of 128,256, untied head, fp32) trains one
step of AdamW on 2,048 tokens (one micro-batch), on CPU. Each row is a fresh interpreter, so one
row's allocations do not shape another's; glibc is told to give every allocation over 64 KiB back
to the system when freed (MALLOC_MMAP_THRESHOLD_), so the resident set follows the live tensors and
its high-water mark (VmHWM, reset through /proc/self/clear_refs before the step) is the step's peak.

- step peak: the high-water mark of the step (forward, backward, optimizer) above the interpreter
  with the libraries the row uses imported (torch and Transformers; PEFT for the LoRA rows) and
  their kernels run once (a step of a tiny model of the same kind), so the peak is the tensors
  `estimate` counts (weights, optimizer state, gradients, activations, logits).
- loss path peak: the high-water mark of the LM head and cross entropy alone (forward and backward
  from 2,047 final hidden states), above what was resident before it.
- loss, gradients: every kernel's against `full`'s at the same weights (lr 0, so the warm-up step
  that allocates the optimizer state moves nothing).
- estimate: `overdrive estimate`'s total for the same model and kernel (target cpu, fp32, 1 device).

Under FSDP2 at 2 processes (gloo, one thread each): the same model and step through overdrive's own
Accelerator (`build_accelerator`, `accelerator.prepare`), 2,048 tokens per rank, each rank's step
peak above its interpreter, the largest of the two; losses (the mean of the ranks' sums) and each
rank's gradient shards against `full`'s under FSDP2; `estimate` is the fsdp2 row at 2 devices.

    python bench/bench_loss_kernel.py            # writes bench/results/loss_kernel.md (and .json)
    python bench/bench_loss_kernel.py --fsdp     # the FSDP2 rows only, the others kept from the .json
    python bench/bench_loss_kernel.py --table    # the table again from the .json, estimates recomputed
    python bench/bench_loss_kernel.py --lora     # the LoRA rows again (the others kept from the .json)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "loss_kernel.md"
RAW = ROOT / "bench" / "results" / "loss_kernel.json"  # the measured rows: `--table` rebuilds the table from them
VOCAB, HIDDEN, TOKENS, LAYERS = 128_256, 256, 2048, 2
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": HIDDEN,
          "intermediate_size": 688, "max_position_embeddings": TOKENS, "num_attention_heads": 4,
          "num_hidden_layers": LAYERS, "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
          "vocab_size": VOCAB, "use_cache": False}
ROWS = [  # (label, kernel, activation offloading, gradient checkpointing)
    ("full", "full", False, False),
    ("chunked", "chunked", False, False),
    ("fused", "fused", False, False),
    ("full, activation offloading", "full", True, False),
    ("chunked, gradient checkpointing", "chunked", False, True),
    ("chunked, checkpointing and offloading", "chunked", True, True),
]
LORA_ROWS = ["full", "chunked", "fused"]  # kernels with LoRA (r 16, all linear layers but the head: a frozen head)
LORA_R = 16
FSDP_ROWS = ["full", "chunked", "fused"]  # kernels under FSDP2 at FSDP_RANKS processes
FSDP_RANKS = 2
GIB = 2**30


def model_config(hidden: int = HIDDEN, tokens: int = TOKENS) -> dict:
    """CONFIG at another hidden size (the MLP's width scaled with it) and length; the bench's own by default."""
    return {**CONFIG, "hidden_size": hidden, "intermediate_size": 688 * hidden // HIDDEN,
            "max_position_embeddings": tokens}


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _loss_path(kernel: str, weight, ids) -> int:
    """The high-water mark of the LM head and cross entropy alone, forward and backward from
    random final hidden states, above what was resident before (bytes)."""
    import torch

    from overdrive.training.step import loss_kernels

    hidden = torch.randn(ids.shape[1] - 1, weight.shape[1], requires_grad=True)
    targets = ids[0, 1:].clone()
    before = _rss()
    _reset_hwm()
    if kernel == "full":
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float(), targets,
                                          reduction="sum").backward()
    else:
        loss_kernels.LOSSES[kernel](hidden, weight, None, targets).backward()
    return _hwm() - before


def child(kernel: str, offload: bool, checkpointing: bool, grads_out: str, lora: bool = False,
          loss_path: bool = True, hidden: int = HIDDEN, tokens: int = TOKENS) -> dict:
    """One row, measured in this (fresh) interpreter; `lora`: PEFT's LoRA on every linear layer but the
    head, which stays frozen (the kernels then compute no weight gradient for it); `loss_path`: the
    head and loss measured alone too (`step-only` on the command line leaves it out); `hidden`, `tokens`:
    the model's width and the step's tokens (`hidden=N tokens=N` on the command line)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from overdrive.training.step import activation_offload, loss_kernels, step_loss

    torch.set_num_threads(2)

    def built(config: dict) -> torch.nn.Module:
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)}))
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0,
                                                     target_modules="all-linear"))
        return model.train()

    # Library code under the floor: PEFT's import (~54 MiB with bitsandbytes') and the kernels' code
    # and set-up, paged in by a step of a tiny model (~10 MiB), are no tensors `estimate` counts.
    tiny = built({**model_config(hidden, 64), "vocab_size": 512})
    warm = torch.randint(0, 512, (1, 64))
    step_loss.summed_loss(tiny, {"input_ids": warm, "labels": warm}, kernel).backward()
    torch.optim.AdamW([p for p in tiny.parameters() if p.requires_grad], lr=0.0).step()
    del tiny, warm
    floor = _rss()
    torch.manual_seed(0)
    model = built(model_config(hidden, tokens))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    activation_offload.attach(model, offload)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.0)
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    def step() -> torch.Tensor:
        loss = step_loss.summed_loss(model, batch, kernel)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for p in trainable:  # the optimizer state allocated by a step on zero gradients (lr 0)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    resting = _rss()
    _reset_hwm()
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    peak = _hwm()
    torch.save({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, grads_out)
    optimizer.zero_grad(set_to_none=True)
    # The loss path alone: head and cross entropy from the final hidden states, forward and backward.
    head = loss_kernels.unwrapped(model).lm_head.weight  # frozen under LoRA
    return {"loss": float(loss), "step_peak": peak - floor, "step_above_resting": peak - resting,
            "resting": resting - floor, "loss_path": _loss_path(kernel, head, ids) if loss_path else None,
            "seconds": seconds,
            "cpu_seconds": cpu_seconds}


def fsdp_child(kernel: str, out_dir: str) -> None:
    """One FSDP2 row on this rank (started by torch.distributed.run): the step through overdrive's
    Accelerator, as `overdrive train` builds it; this rank's numbers and gradient shards to out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from overdrive import build_accelerator, load_config
    from overdrive.training.step import step_loss

    torch.set_num_threads(1)  # two ranks on the machine's cores
    floor = _rss()
    cfg = load_config(overrides={"parallel.strategy": "fsdp", "launch.use_cpu": True,
                                 "launch.num_processes": FSDP_RANKS, "precision.mixed_precision": "no",
                                 "training.loss_kernel": kernel})
    accelerator = build_accelerator(cfg)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures",)}))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1 + rank))
    batch = {"input_ids": ids, "labels": ids}
    for p in model.parameters():  # the optimizer state allocated by a step on zero gradients (lr 0)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    resting = _rss()
    accelerator.wait_for_everyone()
    _reset_hwm()
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = step_loss.summed_loss(model, batch, kernel)
    accelerator.backward(loss)
    optimizer.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    peak = _hwm()
    losses = accelerator.gather(loss.detach().reshape(1))
    torch.save({n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for n, p in model.named_parameters()}, Path(out_dir) / f"grads{rank}.pt")
    # The loss path alone on this rank, as in the one-process rows: the head as FSDP2 gathers it
    # (its unit unsharded), a copy of it taking the gradient, so FSDP2's own hooks are not involved.
    model.lm_head.unshard()
    weight = model.lm_head.weight.detach().clone().requires_grad_()
    model.lm_head.reshard()
    loss_path = _loss_path(kernel, weight, ids)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "loss": float(losses.mean()), "step_peak": peak - floor, "step_above_resting": peak - resting,
        "resting": resting - floor, "seconds": seconds, "cpu_seconds": cpu_seconds, "loss_path": loss_path}))
    accelerator.end_training()


def fsdp_rows(env: dict) -> list[dict]:
    """The FSDP2 rows: each kernel in a fresh job of FSDP_RANKS processes; errors against `full`'s."""
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in FSDP_ROWS:
            out = Path(tmp) / kernel
            out.mkdir()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={FSDP_RANKS}", __file__, "--fsdp-child", kernel, str(out)],
                           check=True, capture_output=True, text=True, env=env)
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(FSDP_RANKS)]
            row = {"label": f"{kernel}, FSDP2 at {FSDP_RANKS} processes", "kernel": kernel, "loss": ranks[0]["loss"],
                   "step_peak": max(r["step_peak"] for r in ranks), "seconds": max(r["seconds"] for r in ranks),
                   "cpu_seconds": max(r["cpu_seconds"] for r in ranks),
                   "resting": max(r["resting"] for r in ranks), "loss_path": max(r["loss_path"] for r in ranks),
                   "grads": [torch.load(out / f"grads{r}.pt") for r in range(FSDP_RANKS)],
                   "estimate": estimate_total(kernel, False, False, strategy="fsdp2", devices=FSDP_RANKS)}
            rows.append(row)
            print(row["label"], {k: v for k, v in row.items() if k != "grads"}, flush=True)
    reference, want = rows[0], rows[0]["grads"]
    for row in rows:
        row["loss_error"] = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
        row["grad_error"] = max(_grad_error(got, shard) for got, shard in zip(row.pop("grads"), want))
    return rows


def lora_rows(env: dict) -> list[dict]:
    """The LoRA rows: each kernel in a fresh interpreter; errors against LoRA with `full`."""
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in LORA_ROWS:
            grads = str(Path(tmp) / f"{kernel}.pt")
            out = subprocess.run([sys.executable, __file__, "--child", kernel, "0", "0", grads, "lora"], check=True,
                                 capture_output=True, text=True, env=env)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row.update(label=f"{kernel}, LoRA r {LORA_R}", kernel=kernel, grads=grads,
                       estimate=estimate_total(kernel, False, False, peft="lora"))
            rows.append(row)
            print(row["label"], {k: v for k, v in row.items() if k != "grads"}, flush=True)
        want = torch.load(rows[0]["grads"])
        for row in rows:
            row["loss_error"] = abs(row["loss"] - rows[0]["loss"]) / abs(rows[0]["loss"])
            row["grad_error"] = _grad_error(torch.load(row.pop("grads")), want)
    return rows


def estimate_total(kernel: str, offload: bool, checkpointing: bool, strategy: str = "ddp", devices: int = 1,
                   peft: str = "none", hidden: int = HIDDEN, tokens: int = TOKENS) -> int:
    """`overdrive estimate`'s total for this row (fp32, target cpu), per device."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(model_config(hidden, tokens)))
        argv = [sys.executable, "-m", "overdrive.cli", "estimate", str(path), "--devices", str(devices), "--precision", "no",
                "--seq-len", str(tokens), "--micro-batch", "1", "--target", "cpu", "--strategies", strategy, "--json",
                "--loss-kernel", kernel]
        if checkpointing:
            argv.append("--checkpointing")
        if offload:
            argv.append("--activation-offloading")
        if peft != "none":
            argv += ["--peft", peft, "--lora-r", str(LORA_R)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out)["rows"][0]["total_bytes"]


def _grad_error(got: dict, want: dict) -> float:
    return max(float((got[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in want.items())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--table":  # estimates again, over the measured rows
        raw = json.loads(RAW.read_text())
        for row, (_, kernel, offload, checkpointing) in zip(raw["rows"], ROWS):
            row["estimate"] = estimate_total(kernel, offload, checkpointing)
        for row in raw["rows"][len(ROWS):]:  # the LoRA rows
            row["estimate"] = estimate_total(row["kernel"], False, False, peft="lora")
        for row in raw.get("fsdp_rows", []):
            row["estimate"] = estimate_total(row["kernel"], False, False, strategy="fsdp2", devices=FSDP_RANKS)
        RAW.write_text(json.dumps(raw, indent=1))
        return 0 if write(raw["rows"], raw["load"], raw.get("fsdp_rows", []), raw.get("fsdp_load")) else 1
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kernel, offload, checkpointing, grads_out = sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5]
        options = sys.argv[6:]  # lora, step-only, hidden=N, tokens=N
        sizes = {k: int(v) for k, v in (o.split("=", 1) for o in options if "=" in o)}
        print(json.dumps(child(kernel, offload, checkpointing, grads_out, lora="lora" in options,
                               loss_path="step-only" not in options, **sizes)))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--fsdp-child":
        fsdp_child(sys.argv[2], sys.argv[3])
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT / "src")}
    if len(sys.argv) > 1 and sys.argv[1] == "--lora":  # the LoRA rows again, the others kept
        raw = json.loads(RAW.read_text())
        raw["rows"] = [r for r in raw["rows"] if "LoRA" not in r["label"]] + lora_rows(env)
        RAW.write_text(json.dumps(raw, indent=1))
        return 0 if write(raw["rows"], raw["load"], raw.get("fsdp_rows", []), raw.get("fsdp_load")) else 1
    if len(sys.argv) > 1 and sys.argv[1] == "--fsdp":  # the FSDP2 rows again, the one-process rows kept
        raw = json.loads(RAW.read_text())
        raw.update(fsdp_rows=fsdp_rows(env), fsdp_load=os.getloadavg()[0])
        RAW.write_text(json.dumps(raw, indent=1))
        return 0 if write(raw["rows"], raw["load"], raw["fsdp_rows"], raw["fsdp_load"]) else 1
    import torch

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, kernel, offload, checkpointing in ROWS:
            grads = str(Path(tmp) / f"{len(results)}.pt")
            out = subprocess.run([sys.executable, __file__, "--child", kernel, str(int(offload)),
                                  str(int(checkpointing)), grads], check=True, capture_output=True, text=True, env=env)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row.update(label=label, kernel=kernel, grads=grads,
                       estimate=estimate_total(kernel, offload, checkpointing))
            results.append(row)
            print(label, {k: v for k, v in row.items() if k != "grads"}, flush=True)
        reference = results[0]
        want = torch.load(reference["grads"])
        for row in results:
            row["loss_error"] = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
            row["grad_error"] = _grad_error(torch.load(row.pop("grads")), want)
    results += lora_rows(env)
    load = os.getloadavg()[0]
    sharded = fsdp_rows(env)
    RAW.write_text(json.dumps({"load": load, "rows": results, "fsdp_rows": sharded,
                               "fsdp_load": os.getloadavg()[0]}, indent=1))
    return 0 if write(results, load, sharded) else 1


def write(results: list[dict], load: float | None = None, sharded: list[dict] = (),
          sharded_load: float | None = None) -> bool:
    """The table, and whether every target was met."""
    full = results[0]
    lines = [
        "# The loss without the logits: peak memory and time per `training.loss_kernel`", "",
        f"Small Llama ({LAYERS} layers, hidden {HIDDEN}, vocabulary {VOCAB:,}, untied head, fp32, "
        f"{TOKENS:,} tokens in one micro-batch), one AdamW step on CPU, "
        f"by `bench/bench_loss_kernel.py`; {os.cpu_count()} CPU cores, load average "
        f"{load if load is not None else os.getloadavg()[0]:.2f} (other work shared the cores: wall "
        "times vary with it; CPU seconds, summed over the threads, do not). Peaks are resident-set high-water marks (VmHWM) in a fresh interpreter per row; "
        "errors are relative to `full` at the same weights. On a CPU the activations are in host memory "
        "already, so offloading moves nothing: its rows show that it changes no number.", "",
        "| row | step peak GiB | estimate GiB | estimate / peak | loss path peak MiB | loss path / full's | "
        "loss rel. error | grad rel. error | s / step | CPU s / step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        full = _full_of(results, r)
        lines.append(f"| {r['label']} | {r['step_peak'] / GIB:.2f} | {r['estimate'] / GIB:.2f} | "
                     f"{r['estimate'] / r['step_peak']:.3f} | {r['loss_path'] / 2**20:,.0f} | "
                     f"{r['loss_path'] / full['loss_path']:.1%} | {r['loss_error']:.1e} | {r['grad_error']:.1e} | "
                     f"{r['seconds']:.1f} | {r.get('cpu_seconds', float('nan')):.1f} |")
    missed = targets_missed(results)
    lines += ["", f"Targets (loss path at most 15% of full's for chunked and fused; loss and gradients within 1e-5 of "
              f"full's; estimate within 10% of the step peak, for the full-parameter rows): "
              f"{'met' if not missed else 'missed: ' + '; '.join(missed)}."]
    lines += ["", "step peak: above the interpreter with torch and Transformers imported. loss path: the LM head and "
              "cross entropy alone, forward and backward from the final hidden states, above what was resident "
              "before (the head's weight gradient, 125 MiB, included in each but the LoRA rows', whose head is "
              "frozen). LoRA rows: PEFT's LoRA (r 16) on every linear layer but the head, errors and the loss path "
              "against LoRA with `full`, gradients those of the adapters."]
    if sharded:
        lines += fsdp_table(sharded, sharded_load)
        missed += fsdp_targets_missed(sharded)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(RESULTS.read_text())
    return not missed


def fsdp_table(rows: list[dict], load: float | None) -> list[str]:
    """The FSDP2 rows: per rank, the larger of the ranks' numbers."""
    full = rows[0]
    lines = ["", f"## Under FSDP2 at {FSDP_RANKS} processes", "",
             f"The same model and step through overdrive's Accelerator (FSDP2 over gloo, one thread per rank), "
             f"{TOKENS:,} tokens per rank, each kernel in a fresh job; load average "
             f"{load if load is not None else os.getloadavg()[0]:.2f}. Per rank: the larger of the ranks' "
             "high-water marks above the interpreter (parameter, gradient and optimizer shards, the gathered head "
             "and embeddings, activations, the loss); above resting: what the step itself added. Errors against "
             "`full` under FSDP2 at the same weights and data: the loss (the ranks' sums, averaged), each rank's "
             "gradient shards. `estimate`: `overdrive estimate --strategies fsdp2 --devices 2` for the same "
             "kernel.", "",
             "| row | step peak per rank GiB | of full's | above resting GiB | of full's | loss path peak MiB | "
             "of full's | estimate GiB | estimate / peak | loss rel. error | grad rel. error | s / step | CPU s / step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        above = r["step_peak"] - r["resting"]
        lines.append(f"| {r['label']} | {r['step_peak'] / GIB:.2f} | {r['step_peak'] / full['step_peak']:.1%} | "
                     f"{above / GIB:.2f} | {above / (full['step_peak'] - full['resting']):.1%} | "
                     f"{r['loss_path'] / 2**20:,.0f} | {r['loss_path'] / full['loss_path']:.1%} | "
                     f"{r['estimate'] / GIB:.2f} | {r['estimate'] / r['step_peak']:.3f} | {r['loss_error']:.1e} | "
                     f"{r['grad_error']:.1e} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} |")
    missed = fsdp_targets_missed(rows)
    lines += ["", "Targets (loss path at most 15% of full's; loss and every rank's gradient shards within 1e-5 of "
              f"full's under FSDP2): {'met' if not missed else 'missed: ' + '; '.join(missed)}. Loss path: on each "
              "rank, the head as FSDP2 gathers it and the cross entropy alone, forward and backward from the final "
              "hidden states (the larger rank's)."]
    return lines


def fsdp_targets_missed(rows: list[dict]) -> list[str]:
    missed = [f"{r['label']}: loss {r['loss_error']:.1e}, gradients {r['grad_error']:.1e}"
              for r in rows if r["loss_error"] > 1e-5 or r["grad_error"] > 1e-5]
    return missed + [f"{r['label']}: loss path {r['loss_path'] / rows[0]['loss_path']:.1%} of full's" for r in rows
                     if r["kernel"] != "full" and r["loss_path"] > 0.15 * rows[0]["loss_path"]]


def _full_of(results: list[dict], row: dict) -> dict:
    """The `full` row a row is compared with: LoRA's for a LoRA row, the first row otherwise."""
    if "LoRA" in row["label"]:
        return next(r for r in results if "LoRA" in r["label"] and r["kernel"] == "full")
    return results[0]


def targets_missed(results: list[dict]) -> list[str]:
    missed = []
    for r in results:
        full = _full_of(results, r)
        if r["kernel"] != "full" and r["loss_path"] > 0.15 * full["loss_path"]:
            missed.append(f"{r['label']}: loss path {r['loss_path'] / full['loss_path']:.1%} of full's")
        if r["loss_error"] > 1e-5 or r["grad_error"] > 1e-5:
            missed.append(f"{r['label']}: loss {r['loss_error']:.1e}, gradients {r['grad_error']:.1e}")
        if "LoRA" not in r["label"] and abs(r["estimate"] / r["step_peak"] - 1) > 0.10:  # shown for LoRA, not a target
            missed.append(f"{r['label']}: estimate {r['estimate'] / r['step_peak']:.3f} of the peak")
    return missed


if __name__ == "__main__":
    sys.exit(main())
