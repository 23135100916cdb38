"""`training.micro_batch_size: auto`: the largest micro-batch that fits, before the first step.

The global batch is `training.global_batch_size` and stays what it is: the micro-batch is
a divisor of the per-process batch (global / processes), and accumulation makes up the rest
(accumulation = global / (micro x processes)). So `auto` never changes what is trained,
only how many samples go through the model at once. (Transformers' `auto_find_batch_size`
halves the micro-batch after each crash and lets the global batch drift with it.)

Three steps, on every process:

1. Prediction: the memory estimator (overdrive.memory) for the configured strategy, at
   every candidate size, against this device's memory (on a CPU: the RAM available now,
   shared by this machine's processes), less 10% headroom. No weights are needed.
2. Probe: a real forward and backward pass of the model, unsharded, at the predicted size
   on this process's device, under the configured precision and checkpointing. On a GPU the
   probe's peak is measured and what it does not exercise is added from the estimator
   (`probe_terms`: the optimizer states, fp32 master weights, communication buffers, and
   the 10% margin); a size fits only when that sum does. An out-of-memory error, or a sum
   over the device's memory, steps down to the next size; a fit steps up while the sum keeps
   fitting. On a CPU only predicted sizes are tried: there, running out of memory is the
   kernel's OOM killer, not an exception.
3. Agreement: every process takes the smallest answer of all processes, so ranks never
   disagree on the batch.

Step 1 runs before the Accelerator is built (`predicted_config`), so every strategy's plugin
(DeepSpeed's batch sizes above all) is built from integers; steps 2 and 3 run right after
(`confirm`), when this process's device is known and the processes can talk, and before
anything is prepared. The trainer calls both.

Under ZeRO-3 and FSDP (parameters sharded) the probe is skipped and the prediction stands:
the probe's model would be the whole fp32 model on one device, which is what sharding
exists to avoid.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import overdrive.config.batch as batch
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.memory import mentions_out_of_memory

HEADROOM = 0.10

Probe = Callable[[int], Optional[str]]  # size -> None when it ran, else why not


@dataclass
class Choice:
    micro_batch: int
    accumulation: int
    predicted: Optional[int]
    tried: list[tuple[int, str]] = field(default_factory=list)  # (size, "ok" or the error)
    note: str = ""

    def describe(self) -> str:
        tried = ", ".join(f"{m}: {what}" for m, what in self.tried) or "no probe"
        return (f"micro_batch_size auto -> {self.micro_batch} x accumulation {self.accumulation} "
                f"(estimator: {self.predicted or 'nothing fits'}; probed {tried}){' ' + self.note if self.note else ''}")


def per_process_batch(cfg: RunConfig, world: int) -> int:
    """Samples per data-parallel replica and optimizer step: the settled split's, on `world` replicas."""
    split = batch.split(cfg)
    return batch.BatchSplit(split.micro, split.accumulation, world, split.global_batch).per_replica


def sizes(per_process: int) -> list[int]:
    """Candidate micro-batches, largest first: the divisors of the per-process batch."""
    return [m for m in range(per_process, 0, -1) if per_process % m == 0]


def predict(cfg: RunConfig, candidates: list[int], capacity: Optional[Any] = None,
            shape: Optional[Any] = None) -> Optional[int]:
    """The largest size the estimator says fits, or None. `shape`: the run's model shape,
    computed once by the caller (else here)."""
    from overdrive.memory import report
    from overdrive.memory.model_shape import run_estimate, run_shape

    capacity = capacity or _capacity()
    shape = shape or run_shape(cfg)
    target = "cpu" if capacity.kind == "host" else "cuda"
    for m in candidates:
        est = run_estimate(cfg, target, shape, micro_batch=m)
        report.apply_verdict(est, capacity, headroom=HEADROOM, nodes=cfg.launch.num_machines)
        if est.rows[0].fits:
            return m
    return None


def _capacity():
    """This device's memory; on a CPU, the RAM available now (other programs use some)."""
    import psutil

    from overdrive.memory import report

    cap = report.detect_capacity()
    if cap.kind == "host":
        available = psutil.virtual_memory().available
        return report.Capacity(available, available, "host", f"{available / 2**30:.1f} GiB of RAM available")
    return cap


def probe_terms(cfg: RunConfig, micro: int, measured_bytes: int, device_bytes: int,
                shape: Optional[Any] = None) -> list[tuple[str, int]]:
    """What a micro-batch needs on a GPU: the probe's measured forward and backward (its
    activations and whole-model gradients; the probe's weights were already resident), plus
    what the probe never allocates, from the estimator for the configured strategy at this
    size, plus the margin. The last term is the device's memory, negative: the size fits when
    the terms sum to <= 0."""
    from overdrive.memory.model_shape import run_estimate

    row = run_estimate(cfg, "cuda", shape, micro_batch=micro).rows[0]
    return [
        ("forward and backward, measured by the probe", int(measured_bytes)),
        ("weights on this rank (estimator)", row.params_bytes),
        ("optimizer states (estimator)", row.optimizer_bytes),
        ("fp32 master weights (estimator)", row.master_weights_bytes),
        ("communication buffers (estimator)", row.buffers_bytes),
        (f"margin ({HEADROOM:.0%} of the device)", int(device_bytes * HEADROOM)),
        ("device memory", -int(device_bytes)),
    ]


def choose(cfg: RunConfig, world: int, probe: Optional[Probe], on_gpu: bool, capacity: Optional[Any] = None,
           agree: Callable[[int], int] = lambda m: m, predicted: Optional[int] = -1) -> Choice:
    """The largest micro-batch that fits, by prediction, probe and agreement (see above).
    `predicted` skips the estimator (-1: ask it)."""
    per_process = per_process_batch(cfg, world)
    candidates = sizes(per_process)
    if predicted == -1:
        predicted = predict(cfg, candidates, capacity)
    start = candidates.index(predicted) if predicted in candidates else len(candidates) - 1
    tried: list[tuple[int, str]] = []
    chosen = None
    if probe is None:
        chosen = candidates[start]
    else:
        # Down from the prediction until one runs; then, on a GPU only, up while it runs.
        for m in candidates[start:]:
            error = probe(m)
            tried.append((m, error or "ok"))
            if error is None:
                chosen = m
                break
        if chosen is not None and on_gpu:
            for m in reversed(candidates[: candidates.index(chosen)]):
                error = probe(m)
                tried.append((m, error or "ok"))
                if error is not None:
                    break
                chosen = m
    if chosen is None:
        raise UserError(_nothing_fits(candidates[-1], tried[-1][1] if tried else "estimate"))
    agreed = agree(chosen)
    note = f"(another process fitted only {agreed})" if agreed != chosen else ""
    if predicted is None:
        note = (note + " the estimator predicted nothing fits; the probe decided").strip()
    return Choice(agreed, per_process // agreed, predicted, tried, note)


# ------------------------------------------------------------------ the real probe

def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or mentions_out_of_memory(str(error))


def make_probe(cfg: RunConfig, device, device_bytes: Optional[int] = None, shape: Optional[Any] = None) -> Probe:
    """Forward and backward of the (unsharded) model at a given micro-batch on `device`; on a
    GPU, judged by `probe_terms` against `device_bytes` (default: the device's total).
    The model is the one that trains (training/build/model.py: its dtype, attention implementation
    and gradient checkpointing, the LoRA adapter), with fresh weights."""
    import torch

    from overdrive.memory.model_shape import hf_config_for_run, run_shape
    from overdrive.training.build import model as model_mod

    config = hf_config_for_run(cfg)  # what the estimator sizes: the tokenizer's vocabulary, no weights
    shape = shape or (run_shape(cfg) if device.type == "cuda" else None)  # probe_terms asks it at every size
    try:
        net = model_mod.fresh_model(cfg, config, device)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not _is_oom(error):
            raise
        gc.collect()
        return lambda m: "out of memory building the whole model on one device"
    on_gpu = device.type == "cuda"
    if on_gpu and device_bytes is None:
        device_bytes = torch.cuda.get_device_properties(device).total_memory
    net = model_mod.with_gradient_checkpointing(cfg, net)
    from overdrive.training.build import adapter

    if adapter.enabled(cfg) and cfg.peft.method == "lora":
        # What trains: the base frozen, PEFT's adapter added (as build_model does), so the probe
        # measures the adapter's gradients, not every weight's. (A qlora base is measured
        # unquantized: fresh weights are not loaded through bitsandbytes.)
        net = adapter.apply(cfg, net, gradient_checkpointing=cfg.model.gradient_checkpointing)
    net.train()
    dtype = model_mod.autocast_dtype(cfg.precision.mixed_precision)
    vocab_size, seq_len = config.vocab_size, cfg.data.max_length
    from overdrive.training.step import loss_kernels, step_loss

    kernel = loss_kernels.for_run(cfg, device)  # the loss's memory as the run will hold it

    def probe(m: int) -> Optional[str]:
        loss = None
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        try:
            ids = torch.randint(0, vocab_size, (m, seq_len), device=device)
            labels = ids if cfg.model.task == "causal-lm" else torch.zeros(m, dtype=torch.long, device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = step_loss.summed_loss(net, {"input_ids": ids, "labels": labels}, kernel)
            loss.backward()
            if on_gpu:
                terms = probe_terms(cfg, m, torch.cuda.max_memory_allocated(device) - before, device_bytes, shape)
                short = sum(b for _, b in terms)
                if short > 0:
                    return f"out of memory with optimizer states, buffers and margin ({short / 2**30:.2f} GiB short)"
            return None
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if _is_oom(error):
                return "out of memory"
            raise
        finally:
            net.zero_grad(set_to_none=True)
            loss = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return probe


def predicted_config(cfg: RunConfig, capacity: Optional[Any] = None, shape: Optional[Any] = None) -> RunConfig:
    """Step 1, before the Accelerator is built: `auto` replaced by the estimator's size, so
    every strategy's plugin is built from integers. When the estimator says nothing fits,
    the probe starts from the smallest size; where no probe runs (parameters sharded), that
    verdict stands: a refusal."""
    from overdrive.strategies import registry

    per_process = batch.split(cfg).per_replica
    candidates = sizes(per_process)
    micro = predict(cfg, candidates, capacity, shape)
    if micro is None and not registry.of(cfg).holds_whole_model(cfg):
        raise UserError(_nothing_fits(candidates[-1], "the estimate for this strategy"))
    micro = micro or candidates[-1]
    return batch.with_split(cfg, micro, per_process // micro)


def _nothing_fits(smallest: int, why: str) -> Problem:
    return Problem("training.micro_batch_size", f"auto: not even a micro-batch of {smallest} fits ({why})",
                   fix="shard more (parallel.strategy=deepspeed with zero_stage 3, or fsdp), turn on "
                   "model.gradient_checkpointing, or shorten data.max_length")


def confirm(cfg: RunConfig, accelerator, probe: Optional[Probe] = None, capacity: Optional[Any] = None) -> RunConfig:
    """Steps 2 and 3, once the Accelerator knows this process's device and the processes can
    talk: probe from the predicted size, agree on the smallest answer, and tell the
    Accelerator (and DeepSpeed's config, read only in prepare()) the final split. The global
    batch, and so DeepSpeed's train_batch_size, does not change."""
    import torch

    device = accelerator.device
    from overdrive import strategies
    from overdrive.strategies import registry

    if probe is None and registry.of(cfg).holds_whole_model(cfg):
        probe = make_probe(cfg, device)

    def agree(m: int) -> int:
        return int(accelerator.gather(torch.tensor([m], device=device)).min().item())

    choice = choose(cfg, batch.split(cfg).data_parallel, probe, device.type == "cuda", capacity, agree,
                    predicted=cfg.training.micro_batch_size)
    probe = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the run's peak memory, not the probe's
    strategies.use_split(accelerator, choice.micro_batch, choice.accumulation)
    if accelerator.is_main_process and cfg.logging.level != "quiet":
        print(f"overdrive: {choice.describe()}", flush=True)
    return batch.with_split(cfg, choice.micro_batch, choice.accumulation)
