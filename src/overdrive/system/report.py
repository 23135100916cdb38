"""`overdrive env`: what a bug report needs to know about this machine and this shell.

Versions, hardware and what it can do, the Accelerate default config in effect (and which
overdrive values it changes), and the environment variables that change a run, secrets
masked. Collected into a plain dict (for `--json`) and rendered as paste-ready markdown.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any, Optional

from overdrive.system.tested import KEY_PACKAGES as PACKAGES


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, Optional[str]]:
    """Installed versions from package metadata: nothing is imported, so this stays fast."""
    from overdrive import __version__
    found: dict[str, Optional[str]] = {"python": platform.python_version(), "overdrive": __version__}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def hardware() -> dict[str, Any]:
    """CPU, RAM, GPUs and the precisions they support (system/hardware.py's detection),
    with the CUDA and NCCL builds torch reports. Imports torch."""
    from overdrive.system import hardware as detection

    machine = detection.detect(light=True)  # CPU and RAM; the GPUs are torch's, below
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_model": machine.cpu_model or None,
        "cpu_logical_cores": os.cpu_count(),
        "cpu_physical_cores": detection.physical_cores(),
        "cpu_bf16_native": machine.cpu_bf16_native,
        "ram_bytes": machine.ram_bytes or None,
        "gpus": [],
        "cuda": None,
        "nccl": None,
        "torch_cuda_build": None,
    }
    try:
        import torch
    except Exception as error:  # torch missing or broken: still report the rest
        info["torch_error"] = str(error)
        return info
    info["torch_cuda_build"] = torch.version.cuda
    info["mps"] = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if not torch.cuda.is_available():
        return info
    info["cuda"] = torch.version.cuda
    try:
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:
        pass
    for index, gpu in enumerate(detection.gpus_from_torch()):
        major, minor = gpu.compute_capability
        info["gpus"].append({"index": index, "name": gpu.name, "memory_bytes": int(gpu.memory_bytes),
                             "capability": f"{major}.{minor}", "bf16": gpu.bf16, "fp8": gpu.fp8})
    return info


def accelerate_default() -> dict[str, Any]:
    from overdrive.config.env_report import MASK, accelerate_default_config_path, is_secret_name

    path = accelerate_default_config_path()
    info: dict[str, Any] = {"path": str(path), "exists": path.is_file(), "content": None}
    if info["exists"]:
        lines = path.read_text(errors="replace").splitlines()
        # A default config holds no credentials by design, but it is a user-edited file.
        masked = []
        for line in lines:
            name, colon, _ = line.partition(":")
            secret = colon and is_secret_name(name.strip())
            masked.append(f"{name}: {MASK}" if secret else line)
        info["content"] = "\n".join(masked)
    return info


def collect(config_layers: dict[str, Any], with_hardware: bool = True) -> dict[str, Any]:
    """The whole report; `config_layers`: what the Accelerate default and the environment
    change in a run's config (resolving/layer_changes.py)."""
    from overdrive.config.env_report import run_variables

    from overdrive.system.tested import canonical, drift, tested_versions

    report: dict[str, Any] = {"versions": versions()}
    pins = tested_versions()
    # Beside each installed version, the one the suite passed on (system/constraints.txt).
    report["tested_versions"] = {name: pins.get(canonical(name)) for name in PACKAGES}
    report["untested"] = [d.package for d in drift(report["versions"], pins)]
    report["hardware"] = hardware() if with_hardware else None
    report["accelerate_default_config"] = accelerate_default()
    report["config_layers"] = config_layers
    report["environment"] = [{"name": n, "value": v} for n, v in run_variables()]
    report["python_executable"] = sys.executable
    return report


def _gib(value: Optional[int]) -> str:
    return "?" if value is None else f"{value / 2**30:.1f} GiB"


def _md_value(value: Any) -> str:
    text = "(empty)" if value is None else str(value)
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def to_markdown(report: dict[str, Any]) -> str:
    out = ["## overdrive env", "", "### Versions", "", "| package | version | tested |", "| --- | --- | --- |"]
    tested, untested = report.get("tested_versions", {}), set(report.get("untested", []))
    for name, version in report["versions"].items():
        mark = " **differs**" if name in untested else ""
        out.append(f"| {name} | {version or 'not installed'} | {tested.get(name) or ''}{mark} |")
    if untested:
        out += ["", f"Outside the tested set: {', '.join(sorted(untested))}. `bash scripts/setup.sh` installs "
                "the tested versions; docs/installing.md says what to do when a newer release breaks a run."]
    hw = report.get("hardware")
    if hw:
        cores = f"{hw['cpu_logical_cores']} logical"
        if hw.get("cpu_physical_cores"):
            cores = f"{hw['cpu_physical_cores']} physical, " + cores
        out += ["", "### Hardware", "", f"- platform: {hw['platform']}"]
        out.append(f"- CPU: {hw.get('cpu_model') or 'unknown'} ({cores} cores)")
        bf16 = "native (AVX512-BF16/AMX)" if hw["cpu_bf16_native"] else "emulated (no AVX512-BF16/AMX)"
        out.append(f"- bf16 on CPU: {bf16}")
        out.append(f"- RAM: {_gib(hw.get('ram_bytes'))}")
        if hw.get("torch_error"):
            out.append(f"- torch: failed to import ({hw['torch_error']})")
        elif not hw["gpus"]:
            build = f"CUDA {hw['torch_cuda_build']} build" if hw.get("torch_cuda_build") else "CPU-only build"
            out.append(f"- GPUs: none visible to torch ({build})")
        else:
            out.append(f"- CUDA {hw['cuda']}, NCCL {hw.get('nccl') or '?'}")
            out += ["", "| GPU | name | memory | capability | bf16 | fp8 |", "| --- | --- | --- | --- | --- | --- |"]
            for gpu in hw["gpus"]:
                out.append(
                    f"| {gpu['index']} | {gpu['name']} | {_gib(gpu['memory_bytes'])} | {gpu['capability']} "
                    f"| {'yes' if gpu['bf16'] else 'no'} | {'yes' if gpu['fp8'] else 'no'} |"
                )
    acc = report["accelerate_default_config"]
    out += ["", "### Accelerate default config", ""]
    if not acc["exists"]:
        out.append(f"None in effect (`{acc['path']}` does not exist).")
    else:
        out += [f"In effect: `{acc['path']}`", "", "```yaml", acc["content"].rstrip(), "```"]
    layers = report["config_layers"]
    changes = layers["changes"]
    from_default = [c for c in changes if c["layer"] == "accelerate-default"]
    from_env = [c for c in changes if c["layer"] == "env"]
    if acc["exists"]:
        out.append("")
        if layers.get("error"):
            out.append("Its effect is unknown: resolving the config fails (see Problems below).")
        elif from_default:
            out += ["What it changes in every overdrive run (layer `accelerate-default`):", ""]
            out += _changes_table(from_default)
        else:
            out.append("It changes no overdrive value (every key equals the schema default or is not used).")
    if from_env:
        out += ["", "### Values set by environment variables", ""] + _changes_table(from_env)
    if layers.get("error") and layers.get("available"):
        out += ["", "### Problems", "",
                "Resolving the config here (defaults, Accelerate default config, environment) fails with:",
                "", layers["error"]]
    out += ["", "### Environment variables that affect a run", ""]
    if not report["environment"]:
        out.append("None set.")
    else:
        out += ["| variable | value |", "| --- | --- |"]
        out += [f"| {v['name']} | {_md_value(v['value'])} |" for v in report["environment"]]
    return "\n".join(out) + "\n"


def _changes_table(changes: list[dict[str, Any]]) -> list[str]:
    rows = ["| key | value | schema default | note |", "| --- | --- | --- | --- |"]
    for c in changes:
        note = f"overridden by {c['overridden_by']}" if c.get("overridden_by") else c.get("where") or ""
        rows.append(f"| {c['key']} | {_md_value(c['value'])} | {_md_value(c['default'])} | {note} |")
    return rows
