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

PACKAGES = ("torch", "accelerate", "transformers", "deepspeed", "datasets", "tokenizers", "pydantic")


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


def _schema_default(key: str) -> Any:
    from overdrive.config.schema import RunConfig

    node: Any = RunConfig()
    for part in key.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        else:
            node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _resolved_value(resolved: Any, key: str) -> Any:
    """The effective value of `key` in whatever shape `resolve()` returns it."""
    for attribute in ("values", "flat"):
        table = getattr(resolved, attribute, None)
        if isinstance(table, dict) and key in table:
            return table[key]
    node = getattr(resolved, "config", resolved)
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def layer_changes(layers: tuple[str, ...] = ("accelerate-default", "env")) -> dict[str, Any]:
    """Keys whose effective value comes from `layers`, via the config resolver.

    Returns {"available": bool, "error": str | None, "changes": [{key, value, default, layer,
    where}]}. The mapping from Accelerate's keys to overdrive's belongs to the resolver; when
    it is not importable this reports that instead of guessing.
    """
    try:
        from overdrive.config import resolve  # type: ignore[attr-defined]
    except ImportError as error:
        return {"available": False, "error": f"overdrive.config.resolve unavailable ({error})", "changes": []}
    from overdrive.config.env_report import MASK, is_secret_name
    from overdrive.errors import UserError

    try:
        resolved = resolve(files=(), cli=())
    except UserError as error:
        return {"available": True, "error": "\n".join(f"- {p.render()}" for p in error.problems), "changes": []}
    changes = []
    chains = getattr(resolved, "chains", None) or {}
    for key, origin in sorted(getattr(resolved, "origins", {}).items()):
        # The chain holds every layer's setting for the key, so a value that a higher layer
        # overrides is still reported: it would come back as soon as that layer is gone.
        settings = [s for s in chains.get(key, []) if s.origin.layer in layers]
        if not settings and getattr(origin, "layer", origin) in layers:
            settings = [None]
        for setting in settings:
            layer = setting.origin.layer if setting else getattr(origin, "layer", origin)
            final_layer = getattr(origin, "layer", origin)
            value = _jsonable(setting.value if setting else _resolved_value(resolved, key))
            default = _jsonable(_schema_default(key))
            if value == default:  # restating a default changes nothing: keep the list short
                continue
            if is_secret_name(key):
                value = MASK
            changes.append(
                {
                    "key": key,
                    "value": value,
                    "default": default,
                    "layer": layer,
                    "where": _where(setting.origin if setting else origin),
                    "overridden_by": None if final_layer == layer else str(origin),
                }
            )
    return {"available": True, "error": None, "changes": changes}


def _where(origin: Any) -> str:
    source, line = getattr(origin, "source", None), getattr(origin, "line", None)
    return f"{source}:{line}" if source and line else str(source or "")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, tuple):
        return list(value)
    return value


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


def collect(with_hardware: bool = True) -> dict[str, Any]:
    from overdrive.config.env_report import run_variables

    report: dict[str, Any] = {"versions": versions()}
    report["hardware"] = hardware() if with_hardware else None
    report["accelerate_default_config"] = accelerate_default()
    report["config_layers"] = layer_changes()
    report["environment"] = [{"name": n, "value": v} for n, v in run_variables()]
    report["python_executable"] = sys.executable
    return report


def _gib(value: Optional[int]) -> str:
    return "?" if value is None else f"{value / 2**30:.1f} GiB"


def _md_value(value: Any) -> str:
    text = "(empty)" if value is None else str(value)
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def to_markdown(report: dict[str, Any]) -> str:
    out = ["## overdrive env", "", "### Versions", "", "| package | version |", "| --- | --- |"]
    for name, version in report["versions"].items():
        out.append(f"| {name} | {version or 'not installed'} |")
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
