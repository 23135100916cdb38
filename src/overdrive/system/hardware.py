"""What this machine has: GPUs, their memory and precision support, CPU cores, RAM.

The one place that detects the machine: `overdrive env` (system/report.py), the hardware
checks of explain/train, plan, the tuner and telemetry's CPU peak all read it from here.
`detect(light=True)` answers without importing torch (nvidia-smi, /proc), so `explain` stays
fast; `detect(light=False)` asks torch, which is exact and what training uses.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]

    @property
    def bf16(self) -> bool:  # bf16 tensor cores from Ampere (8.0)
        return self.compute_capability >= (8, 0)

    @property
    def fp8(self) -> bool:  # FP8 tensor cores from Ada/Hopper (8.9)
        return self.compute_capability >= (8, 9)


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)
    cpu_cores: int = 1
    ram_bytes: int = 0
    cpu_model: str = ""
    cpu_flags: frozenset[str] = field(default=frozenset(), repr=False)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def supports_bf16(self) -> bool:
        return not self.gpus or all(g.bf16 for g in self.gpus)

    @property
    def supports_fp8(self) -> bool:
        return bool(self.gpus) and all(g.fp8 for g in self.gpus)

    @property
    def cpu_bf16_native(self) -> bool:
        # Native bf16 matmuls on x86 need AVX512-BF16 or AMX; without them bf16 autocast on
        # the CPU still works but is emulated and usually slower than fp32.
        return bool(self.cpu_flags & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        cpu = f"{self.cpu_cores} CPU cores, {self.ram_bytes / 2**30:.0f} GiB RAM"
        if not self.gpus:
            return f"no GPU; {cpu}"
        first = self.gpus[0]
        major, minor = first.compute_capability
        return f"{self.gpu_count} x {first.name} ({first.memory_bytes / 2**30:.0f} GiB, sm_{major}{minor}); {cpu}"


def cpu_info() -> tuple[str, frozenset[str]]:
    """CPU model name and feature flags from /proc/cpuinfo (Linux); elsewhere platform's guess."""
    model = ""
    flags: frozenset[str] = frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's marketing name (for caches keyed by machine, and for reports)."""
    return cpu_info()[0]


def physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unable to tell
        return None


def ram_bytes() -> int:
    """Total RAM; 0 when it cannot be told."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _gpus_from_nvidia_smi() -> tuple[Gpu, ...]:
    if not shutil.which("nvidia-smi"):
        return ()
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return ()
    gpus = []
    for line in output.strip().splitlines():
        name, memory_mib, capability = (part.strip() for part in line.split(","))
        major, _, minor = capability.partition(".")
        gpus.append(Gpu(name, int(float(memory_mib)) * 2**20, (int(major), int(minor or 0))))
    return tuple(gpus)


def gpus_from_torch() -> tuple[Gpu, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(Gpu(props.name, props.total_memory, (props.major, props.minor)))
    return tuple(gpus)


def detect(light: bool = True, look_for_gpus: bool = True) -> Hardware:
    """This machine. `look_for_gpus=False`: its CPUs and memory only (for a run told to use the CPU)."""
    gpus = (_gpus_from_nvidia_smi() if light else gpus_from_torch()) if look_for_gpus else ()
    model, flags = cpu_info()
    return Hardware(gpus=gpus, cpu_cores=os.cpu_count() or 1, ram_bytes=ram_bytes(), cpu_model=model, cpu_flags=flags)
