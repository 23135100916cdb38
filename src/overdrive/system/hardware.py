"""What this machine has: GPUs, their memory and precision support, CPU cores, RAM.

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


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)
    cpu_cores: int = 1
    ram_bytes: int = 0

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def supports_bf16(self) -> bool:
        return not self.gpus or all(g.compute_capability >= (8, 0) for g in self.gpus)

    @property
    def supports_fp8(self) -> bool:
        return bool(self.gpus) and all(g.compute_capability >= (8, 9) for g in self.gpus)

    def describe(self) -> str:
        cpu = f"{self.cpu_cores} CPU cores, {self.ram_bytes / 2**30:.0f} GiB RAM"
        if not self.gpus:
            return f"no GPU; {cpu}"
        first = self.gpus[0]
        major, minor = first.compute_capability
        return f"{self.gpu_count} x {first.name} ({first.memory_bytes / 2**30:.0f} GiB, sm_{major}{minor}); {cpu}"


def cpu_model() -> str:
    """The CPU's marketing name (for caches keyed by machine, and for reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
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


def _gpus_from_torch() -> tuple[Gpu, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(Gpu(props.name, props.total_memory, (props.major, props.minor)))
    return tuple(gpus)


def detect(light: bool = True) -> Hardware:
    gpus = _gpus_from_nvidia_smi() if light else _gpus_from_torch()
    return Hardware(gpus=gpus, cpu_cores=os.cpu_count() or 1, ram_bytes=_ram_bytes())
