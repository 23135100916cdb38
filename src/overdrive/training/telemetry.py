"""What a run reports: throughput, MFU, peak memory, metrics.jsonl, progress, trackers.

MFU (model FLOPs utilisation) follows PaLM (Chowdhery et al. 2022, appendix B): training
costs 6N FLOPs per token for the N weights of the matrix multiplies (2 forward, 4 backward)
plus 12 * n_layer * n_embd * seq_len for attention scores and values. Dividing achieved
FLOPs/s by the device's peak says how much of the hardware the run uses, independent of
model size. Peaks come from a table of accelerators (dense bf16/fp16 tensor-core numbers
from vendor data sheets) or, on a CPU, from a measured matrix multiply, cached.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from overdrive.config.keys import flatten
from overdrive.training import metrics as metrics_file
from overdrive.training.metrics import MetricsLog  # noqa: F401 - the writer, kept where the loop finds it
from overdrive.system.hardware import cpu_model
from overdrive.storage.whole_file import replace_whole

# Dense (not sparse) peak FLOPs/s per device from vendor data sheets, by precision: fp32
# without tensor cores (torch's default matmul precision), 16-bit tensor cores (fp16/bf16),
# fp8 tensor cores (None: no fp8). Matched against torch.cuda.get_device_name() as whole
# words ("RTX A1000" is not an A100, "L40S" is not an L40); the first match wins, so the
# variants come before the plain name.
GPU_PEAK_FLOPS: dict[str, tuple[float, float, Optional[float]]] = {
    "H100 PCIe": (51e12, 756e12, 1513e12),
    "H100 NVL": (60e12, 835e12, 1671e12),
    "H200 NVL": (60e12, 835e12, 1671e12),
    "GH200": (67e12, 989e12, 1979e12),
    "H100": (67e12, 989e12, 1979e12),  # SXM
    "H200": (67e12, 989e12, 1979e12),
    "B200": (75e12, 2250e12, 4500e12),
    "A100": (19.5e12, 312e12, None),
    "A800": (19.5e12, 312e12, None),
    "L40S": (91.6e12, 362e12, 733e12),
    "L40": (90.5e12, 181e12, 362e12),
    "L4": (30.3e12, 121e12, 242e12),
    "A10G": (31.2e12, 70e12, None),
    "A10": (31.2e12, 125e12, None),
    "A6000": (38.7e12, 155e12, None),
    "RTX 4090": (82.6e12, 165e12, 330e12),
    "RTX 3090": (35.6e12, 71e12, None),
    "V100": (15.7e12, 125e12, None),  # 16-bit: fp16 (no bf16 on Volta)
    "T4": (8.1e12, 65e12, None),  # 16-bit: fp16
}


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int, frozen_params: int = 0) -> float:
    """Training FLOPs per token: 6N + 12 * n_layer * n_embd * seq_len (PaLM appendix B).

    Of N, `frozen_params` (an adapter run's base) take part in the forward pass (2) and in
    the backward pass for the activations' gradients (2), but get no weight gradient: 4 each."""
    return 6.0 * n_params - 2.0 * frozen_params + 12.0 * n_layer * n_embd * seq_len


def gpu_peak_flops(device_name: str, mixed_precision: str = "bf16") -> Optional[float]:
    """The data-sheet peak of this GPU at the run's precision, or None when unknown."""
    import re

    for key, (fp32, half, fp8) in GPU_PEAK_FLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            return {"no": fp32, "fp16": half, "bf16": half, "fp8": fp8 or half}.get(mixed_precision, fp32)
    return None


_PROBE_BUDGET_S = 2.0  # the most one larger probe size may take


def measure_matmul_flops(dtype: torch.dtype = torch.float32, sizes=(512, 1024, 2048), repeats: int = 3) -> float:
    """Best achieved FLOPs/s of square matrix multiplies on this CPU with the current threads.

    The best over several sizes and repeats: the peak is what the hardware can do, so a
    repeat slowed by another process or a size that misses the cache should not lower it.
    """
    best = 0.0
    # Its own generator: a probe taken mid-run must not move the run's random stream.
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        a, b = (torch.randn(n, n, dtype=dtype, generator=generator) for _ in range(2))
        start = time.perf_counter()
        torch.mm(a, b)  # warm-up: the first call pays for allocation and kernel selection
        warm_up_s = time.perf_counter() - start
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2.0 * n**3 / max(time.perf_counter() - start, 1e-9))
        # A kernel without hardware support (bf16 on most CPUs) is ~70x slower than fp32: the
        # next size costs 8x this one, minutes at 2048, and would say no more about the peak.
        if warm_up_s * 8 > _PROBE_BUDGET_S:
            break
    return best


def cpu_peak_flops(dtype: torch.dtype, cache_dir: Optional[Path]) -> float:
    return cpu_peak(dtype, cache_dir)[0]


def cpu_peak(dtype: torch.dtype, cache_dir: Optional[Path]) -> tuple[float, str]:
    """Measured CPU matmul peak, cached per (CPU, threads, dtype, torch) in `cache_dir`.

    A measurement taken while other processes share the cores comes out low (and MFU then
    high), so the cache keeps the best seen: a cached value is topped up by a quick probe
    (tens of milliseconds) on every run and only ever rises towards the true peak.
    """
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    path = Path(cache_dir) / "peak_flops.json" if cache_dir else None
    cache: dict[str, float] = {}
    if path and path.exists():
        try:
            cache = json.loads(path.read_text())
        except ValueError:
            cache = {}
    measured = measure_matmul_flops(dtype) if key not in cache else \
        measure_matmul_flops(dtype, sizes=(512, 1024), repeats=2)
    if measured > cache.get(key, 0.0):
        cache[key] = measured
        if path:
            with contextlib.suppress(OSError):  # a read-only or full cache: the measurement is only not kept
                replace_whole(path, json.dumps(cache, indent=1))
        return cache[key], "measured"
    return cache[key], "cached"  # an earlier run measured more than this run's probe


def device_peak_flops(device: torch.device, mixed_precision: str, cache_dir: Optional[Path]) -> Optional[float]:
    """Peak FLOPs/s of one device, or None when unknown (MFU is then not reported)."""
    return device_peak(device, mixed_precision, cache_dir)[0]


def device_peak(device: torch.device, mixed_precision: str, cache_dir: Optional[Path]) -> tuple[Optional[float], str]:
    """(peak FLOPs/s, where it came from: "data sheet", "measured" by this run, "cached" from an
    earlier run's measurement), or (None, "") when unknown."""
    if device.type == "cuda":
        flops = gpu_peak_flops(torch.cuda.get_device_name(device), mixed_precision)
        return flops, "data sheet" if flops else ""
    if device.type == "cpu":
        from overdrive.training.build.model import autocast_dtype

        dtype = autocast_dtype(mixed_precision) or torch.float32
        return cpu_peak(dtype, cache_dir)
    return None, ""


class DevicePeak:
    """A device's peak FLOPs/s and the MFU of an achieved rate against it.

    On a CPU the peak is measured, and a measurement taken while other processes held the
    cores is too low: the first time the run itself goes faster than the peak, the peak is
    measured again (a probe of tens of milliseconds, at a logging step) and the best is kept.
    Once only: a run that still outpaces it (the FLOP count is a model, not a measurement)
    must not pay for a probe at every log.
    """

    def __init__(self, device: torch.device, mixed_precision: str, cache_dir: Optional[Path]):
        self.device, self.mixed_precision, self.cache_dir = device, mixed_precision, cache_dir
        self.flops, self.source = device_peak(device, mixed_precision, cache_dir)
        self.may_remeasure = device.type == "cpu"

    def mfu(self, achieved_flops: float) -> Optional[float]:
        if self.flops is None:
            return None
        if achieved_flops > self.flops and self.may_remeasure:
            self.may_remeasure = False
            again, source = device_peak(self.device, self.mixed_precision, self.cache_dir)
            if again is not None and again > self.flops:
                self.flops, self.source = again, source
        return achieved_flops / self.flops

    def fields(self) -> dict:
        """metrics.jsonl's record of the peak MFU is taken against: its FLOPs/s and its source
        (a CPU's peak measured under another job's load reads low, and MFU high)."""
        return {"peak_flops": self.flops, "peak_flops_source": self.source or None}


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated on the GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in kilobytes on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class Throughput:
    """Tokens per second over the window since the last read (host-side counts only)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.start = self.window_start = clock()
        self.window_tokens = 0
        self.total_tokens = 0

    def add(self, tokens: int) -> None:
        self.window_tokens += tokens
        self.total_tokens += tokens

    def read(self) -> float:
        """Tokens/s since the previous read. Call after a sync point (e.g. loss.item())."""
        now = self.clock()
        self.window_s = max(now - self.window_start, 1e-9)
        rate = self.window_tokens / self.window_s
        self.window_start, self.window_tokens = now, 0
        return rate

    def rate_of(self, count: Optional[float]) -> Optional[float]:
        """`count` (tokens in the loss, all ranks) per second over the window the last read closed:
        beside tokens_per_s, which counts every input token, padding included."""
        seconds = getattr(self, "window_s", None)
        return None if count is None or not seconds else count / seconds

    def elapsed(self) -> float:
        return self.clock() - self.start


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressDisplay:
    """A rich progress bar on a terminal, plain lines otherwise; silent off the main process."""

    def __init__(self, total_steps: int, enabled: bool = True, bar: bool = True, stream=None):
        from rich.console import Console

        self.total, self.enabled = total_steps, enabled
        self.console = Console(file=stream or sys.stdout)
        self.bar = None
        if enabled and bar and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn(), console=self.console, transient=False)
            self.task = self.bar.add_task("train", total=total_steps, info="")
            self.bar.start()
        self.started = time.perf_counter()

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        info = _format(values)
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
            return
        per_step = (time.perf_counter() - self.started) / max(step, 1)
        print(f"step {step}/{self.total}  {info}  eta {_eta(per_step * (self.total - step))}",
              file=self.console.file, flush=True)

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.console.print if self.bar else lambda t: print(t, file=self.console.file, flush=True))(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# What a preference run is watched by (TRL's names, training/objectives/preference.py), on its progress lines.
PREFERENCE_SHOWN = tuple((f"{prefix}{name}", f"{prefix}{name} {{:.4f}}") for prefix in ("", "eval_")
                         for name in metrics_file.PREFERENCE_WATCHED)


def _format(values: Mapping[str, Any]) -> str:
    parts = []
    for key, fmt in (("loss", "loss {:.4f}"), ("reward", "reward {:.3f}"), ("eval_loss", "eval_loss {:.4f}"),
                     ("eval_accuracy", "acc {:.3f}"), *PREFERENCE_SHOWN, ("lr", "lr {:.2e}"),
                     ("tokens_per_s", "{:,.0f} tok/s"), ("mfu", "mfu {:.1%}")):
        if values.get(key) is not None:
            parts.append(fmt.format(values[key]))
            if key == "tokens_per_s" and _few_in_the_loss(values):
                # tok/s counts every input token, padding and prompts included: a chat run with short
                # answers looks busy. The rate of what trains, beside it, when it is much lower.
                parts[-1] += f" ({values['loss_tokens_per_s']:,.0f} in the loss)"
    # The benchmarks of eval.tasks (`eval/<task>/<metric>`), their stderr left to metrics.jsonl.
    from overdrive.config.schema_eval import BENCHMARK_PREFIX, is_benchmark_metric

    parts += [f"{key[len(BENCHMARK_PREFIX):]} {value:.4g}" for key, value in values.items()
              if is_benchmark_metric(key) and not key.endswith("_stderr") and isinstance(value, (int, float))]
    return "  ".join(parts)


def _few_in_the_loss(values: Mapping[str, Any]) -> bool:
    rate, total = values.get("loss_tokens_per_s"), values.get("tokens_per_s")
    return rate is not None and bool(total) and rate < 0.9 * total


def resolve_trackers(requested: list[str]) -> list[str]:
    """`auto` becomes tensorboard when it is installed; `none` turns tracking off."""
    names: list[str] = []
    for name in requested:
        if name == "auto":
            from accelerate.utils import is_tensorboard_available

            if is_tensorboard_available():
                names.append("tensorboard")
        elif name not in ("none", "") and name not in names:
            names.append(name)
    return names


def flat_config(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys with scalar values: what trackers' hyper-parameter tables accept."""
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in flatten(values, prefix).items() if not isinstance(value, Mapping)}
