"""The bottleneck of a profiled job and the keys to change, from the measurement.

Pure: phases per rank (profiling.py) in, `bottleneck` and `advice` out. The thresholds say
when a share of the step is worth acting on; the advice names the key, the value, why, and
what to expect, and `overdrive profile --try` measures the first one.
"""

from __future__ import annotations

from statistics import mean
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

DATA_SHARE = 0.20  # waiting for batches beyond this: the loader is the bottleneck
COMMUNICATION_SHARE = 0.25
HOST_SHARE = 0.30  # time in none of the phases: Python and launch overhead
MEMORY_FULL = 0.90  # peak memory beyond this share of the device: memory-bound
MEMORY_HEADROOM = 0.50  # below this share: room for a larger micro-batch


def shares(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's mean share of the step over the ranks."""
    names = ranks[0]["phases"].keys()
    return {p: mean(r["phases"][p] / max(r["step_s"], 1e-12) for r in ranks) for p in names}


def _advice(key: str, value: Any, why: str, expected: str) -> dict[str, Any]:
    return {"key": key, "value": value, "why": why, "expected": expected}


def lighter_sharding(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """Less parameter traffic for a strategy that shards parameters (asked of strategies/)."""
    from overdrive.strategies import registry

    strategy = registry.of(cfg)
    if not strategy.sharding(cfg).parameters:
        return None
    if strategy.engine_steps_optimizer:  # DeepSpeed's engine: stage 3 -> stage 2
        return _advice(f"{strategy.section}.zero_stage", 2,
                       "ZeRO-3 gathers every layer's parameters in forward and again in backward; ZeRO-2 keeps whole "
                       "parameters on each rank and shards only gradients and optimizer state",
                       "the parameter all-gathers disappear: communication falls by about two thirds, memory rises by "
                       "the parameters")
    return _advice(f"{strategy.section}.reshard_after_forward", False,
                   "resharding after forward gathers the parameters again in backward; keeping them (ZeRO-2-like) "
                   "saves that all-gather", "one all-gather fewer per layer and step, at the memory of the parameters")


def judge(cfg: RunConfig, ranks: list[dict[str, Any]], capacity_bytes: Optional[float] = None,
          cores_per_process: int = 1, cuda: bool = False,
          fast_bf16: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """`fast_bf16`: the device multiplies bf16 natively (a GPU from Ampere on, or a CPU with
    AMX / AVX512-BF16). Without it bf16 is emulated and slower than fp32, so it is not advised."""
    share = shares(ranks)
    peak = max(r["peak_memory_bytes"] for r in ranks)
    used = peak / capacity_bytes if capacity_bytes else None
    t, d = cfg.training, cfg.data
    advice: list[dict[str, Any]] = []
    if used is not None and used >= MEMORY_FULL:
        bottleneck = "memory"
        if not cfg.model.gradient_checkpointing:
            advice.append(_advice("model.gradient_checkpointing", True,
                                  f"peak memory is {used:.0%} of the device", "activations recomputed in backward: "
                                  "far less memory for about 30% more compute"))
    elif share["data"] >= DATA_SHARE:
        bottleneck = "data"
        workers = min(d.num_workers + 2, max(cores_per_process, d.num_workers + 1))
        advice.append(_advice("data.num_workers", workers,
                              f"{share['data']:.0%} of each step waits for the next batch, loaded in the training "
                              f"process{' itself' if d.num_workers == 0 else ' by too few workers'}",
                              f"batches prepared ahead by worker processes: up to {1 / (1 - share['data']):.2f}x steps/s"))
        if cuda and not d.pin_memory:
            advice.append(_advice("data.pin_memory", True, "pageable host memory copies to the GPU synchronously",
                                  "asynchronous host-to-device copies"))
    elif share["communication"] >= COMMUNICATION_SHARE:
        bottleneck = "communication"
        c = share["communication"]
        advice.append(_advice("training.gradient_accumulation_steps", t.gradient_accumulation_steps * 2,
                              f"{c:.0%} of each step is communication not hidden behind compute; the gradient "
                              "reduction happens once per optimizer step, so more micro-batches per step share it",
                              f"about {1 / (1 - c / 2):.2f}x tokens/s; the global batch doubles (retune optim.lr "
                              "if it matters)"))
        lighter = lighter_sharding(cfg)
        if lighter:
            advice.insert(0 if c >= 0.5 else 1, lighter)
    elif share["other"] >= HOST_SHARE:
        bottleneck = "host"
        if not cfg.compile.backend:
            advice.append(_advice("compile.backend", "inductor", f"{share['other']:.0%} of each step is outside the "
                                  "measured phases: Python and operator-launch overhead", "fewer, fused kernels: "
                                  "typically 1.1-1.5x steps/s"))
    else:
        bottleneck = "compute"
    if bottleneck in ("compute", "host"):
        if cfg.precision.mixed_precision == "no" and fast_bf16:
            advice.append(_advice("precision.mixed_precision", "bf16", "the step is compute-bound at fp32",
                                  "16-bit matmuls: up to 2x or more on GPU tensor cores or a CPU's AMX"))
        if not cfg.compile.backend and not any(a["key"] == "compile.backend" for a in advice):
            advice.append(_advice("compile.backend", "inductor", "compute-bound: fused kernels do the same math in "
                                  "fewer passes over memory", "typically 1.1-1.5x steps/s after compilation"))
    if used is not None and used < MEMORY_HEADROOM and isinstance(t.micro_batch_size, int) \
            and bottleneck != "memory":
        advice.append(_advice("training.micro_batch_size", t.micro_batch_size * 2,
                              f"peak memory is only {used:.0%} of the device", "more tokens per kernel: better device "
                              "use, and fewer steps' overheads per token"))
    return bottleneck, advice
