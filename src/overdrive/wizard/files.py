"""What the wizard's answers become: a commented run config, and Accelerate's default config.

The run config is written by hand rather than dumped, so every key carries its schema
description as a comment; it is validated against the schema before it is returned. The
Accelerate file uses the keys of Accelerate's ClusterConfig and is checked with
Accelerate's own loader before it replaces anything.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path
from typing import Any

from overdrive.strategies import registry
from overdrive.wizard.questions import Answers


def _deepspeed_section(a: Answers) -> dict[str, Any]:
    ds: dict[str, Any] = {"zero_stage": a.zero_stage, "offload_optimizer": a.offload_optimizer}
    if a.zero_stage == 3:
        ds["offload_param"] = a.offload_param
    if a.nvme_path:
        ds["nvme_path"] = a.nvme_path
    return ds


def _fsdp_section(a: Answers) -> dict[str, Any]:
    return {"reshard_after_forward": a.reshard_after_forward, "offload_params": a.fsdp_offload_params}


# The strategy's own section of the run config (`parallel.<name>`), from the answers asked for it.
_STRATEGY_SECTIONS = {registry.DEEPSPEED.name: _deepspeed_section, registry.FSDP.name: _fsdp_section}


def run_config(a: Answers) -> dict[str, Any]:
    """The nested run config the answers describe: only what the wizard asked about."""
    cfg: dict[str, Any] = {}
    if a.model:
        cfg["model"] = {"name_or_path": a.model}
    if a.peft != "none":
        cfg["peft"] = {"method": a.peft, "r": a.lora_r}
    cfg["precision"] = {"mixed_precision": a.mixed_precision}
    cfg["training"] = {"gradient_accumulation_steps": a.accum}
    parallel: dict[str, Any] = {"strategy": a.strategy}
    section = _STRATEGY_SECTIONS.get(a.strategy)
    if section:
        parallel[a.strategy] = section(a)
    if a.tp_size > 1:
        parallel["tp_size"] = a.tp_size
    if a.dp_replicate_size > 1:
        parallel["dp_replicate_size"] = a.dp_replicate_size
    cfg["parallel"] = parallel
    if a.compile_backend:
        cfg["compile"] = {"backend": a.compile_backend}
    launch: dict[str, Any] = {"num_processes": a.num_processes, "num_machines": a.num_machines}
    if a.num_machines > 1:
        launch.update(machine_rank=a.machine_rank, main_process_ip=a.main_process_ip,
                      main_process_port=a.main_process_port)
    if a.machine_type == "cpu":
        launch["use_cpu"] = True
    cfg["launch"] = launch
    return cfg


def _description(model: type, name: str) -> str:
    info = getattr(model, "model_fields", {}).get(name)
    return (info.description or "") if info is not None else ""


def _scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _emit(data: dict[str, Any], model: type, indent: int, out: list[str]) -> None:
    """YAML by hand, so that every key is preceded by its schema description as a comment."""
    pad = "  " * indent
    for key, value in data.items():
        info = model.model_fields[key]
        if isinstance(value, dict):
            sub = info.annotation
            out.append(f"{pad}{key}:" + (f"  # {sub.__doc__.splitlines()[0]}" if indent == 0 and sub.__doc__ else ""))
            _emit(value, sub, indent + 1, out)
        else:
            description = _description(model, key)
            if description:
                out.append(f"{pad}# {description}")
            out.append(f"{pad}{key}: {_scalar(value)}")


def own_output_dir(config_path: str) -> str:
    """runs/<the config file's stem>: where the run of a config overdrive wrote goes."""
    from pathlib import PurePath

    return f"runs/{PurePath(config_path).stem or 'run'}"


def render_yaml(a: Answers, hw: dict[str, Any], path: str) -> str:
    from overdrive.config.schema import RunConfig

    # A directory of its own: a first run of every config landing in runs/default would resume,
    # or be judged against, whatever ran there before.
    cfg = {"output_dir": own_output_dir(path), **run_config(a)}
    RunConfig.model_validate(cfg)  # the wizard must never write a file the schema rejects
    today = datetime.date.today().isoformat()
    out = [
        f"# overdrive run config, written by `overdrive config` on {today}.",
        f"# Detected where it was written: {hardware_line(hw)}.",
        "# Only what the wizard asked is set here; everything else keeps its schema default.",
        f"#   every effective value:  overdrive explain {path}",
        f"#   train:                  overdrive train {path}",
    ]
    out += [f"# Note: {' '.join(note.split())}." for note in a.notes]  # one line each: stays a comment
    out.append("")
    sections = list(cfg.items())
    for i, (section, values) in enumerate(sections):
        _emit({section: values}, RunConfig, 0, out)
        if i < len(sections) - 1:
            out.append("")
    return "\n".join(out) + "\n"


def hardware_line(hw: dict[str, Any]) -> str:
    parts = [f"{hw.get('cpu_logical_cores') or '?'} CPU cores"]
    if hw.get("ram_bytes"):
        parts.append(f"{hw['ram_bytes'] / 2**30:.0f} GiB RAM")
    gpus = hw.get("gpus") or []
    if gpus:
        memory = gpus[0]["memory_bytes"] / 2**30
        parts.append(f"{len(gpus)} x {gpus[0]['name']} ({memory:.0f} GiB, bf16 {'yes' if gpus[0]['bf16'] else 'no'})")
    else:
        parts.append("no GPU")
    return ", ".join(parts)


def accelerate_config(a: Answers) -> dict[str, Any]:
    """The same choices as Accelerate's ClusterConfig, for plain `accelerate launch`: written
    by interop/writing.py (the one writer of Accelerate YAML) from the run config the answers make."""
    from overdrive.config.schema import RunConfig
    from overdrive.interop import writing

    return writing.accelerate_config(RunConfig.model_validate(run_config(a)))


def write_accelerate_default(a: Answers, path) -> None:
    """Write atomically, after Accelerate's own loader has accepted the content."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Accelerate default config, written by `overdrive config --accelerate-default`.\n"
        "# Every `accelerate launch` on this machine reads it, and so does overdrive (layer\n"
        "# `accelerate-default`): delete it when it no longer describes your runs.\n"
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".default_config.", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(header + yaml.safe_dump(accelerate_config(a), sort_keys=True))
        load_config_from_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
