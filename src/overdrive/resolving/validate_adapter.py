"""`peft.adapter_path`: an adapter that exists, continued. Its adapter_config.json (PEFT's) is read
and compared with `peft.*` key by key: a value set in the run's config that disagrees is refused
(the run would train another adapter than the config says); a value left at overdrive's default
that disagrees is named in a warning, since PEFT trains the adapter as it was saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from overdrive.errors import Problem
from overdrive.hf.lora import adapter_config

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig
    from overdrive.config.schema_peft import PeftConfig

# peft.* key -> (PEFT's adapter_config.json key, the run's value of it)
KEYS: dict[str, tuple[str, Callable[["PeftConfig"], Any]]] = {
    "peft.r": ("r", lambda p: p.r), "peft.alpha": ("lora_alpha", lambda p: p.alpha),
    "peft.dropout": ("lora_dropout", lambda p: p.dropout), "peft.target_modules": ("target_modules", lambda p: p.target_modules),
    "peft.use_dora": ("use_dora", lambda p: p.use_dora), "peft.use_rslora": ("use_rslora", lambda p: p.use_rslora),
    "peft.modules_to_save": ("modules_to_save", lambda p: p.modules_to_save)}


def _same(key: str, ours, theirs) -> bool:
    if key == "peft.target_modules":
        if ours == "all-linear" or theirs in (None, "all-linear"):
            return True  # PEFT saves all-linear as the names it found: the model decides
        return sorted(ours) == sorted([theirs] if isinstance(theirs, str) else theirs)
    if key == "peft.modules_to_save":
        return sorted(ours or []) == sorted(theirs or [])
    if isinstance(ours, bool):
        return ours == bool(theirs)
    return theirs is not None and float(ours) == float(theirs) if not isinstance(ours, list) else ours == theirs


def adapter_rules(cfg: RunConfig, where: Callable[[str], str], explicit: Callable[[str], bool]) -> tuple[list[Problem], list[Problem]]:
    p = cfg.peft
    if not p.adapter_path:
        return [], []
    here = where("peft.adapter_path")
    if p.method == "none":
        return [Problem("peft.adapter_path", "an adapter to continue, but peft.method is none", here,
                        "set peft.method=lora (or qlora)")], []
    try:
        saved = adapter_config(p.adapter_path)
    except ValueError as error:
        return [Problem("peft.adapter_path", str(error), here, "point it at a PEFT adapter directory "
                        "(save_pretrained of a PeftModel: adapter_config.json and adapter_model.safetensors)")], []
    errors, warnings = [], []
    for key, (name, of) in KEYS.items():
        ours, theirs = of(p), saved.get(name)
        if _same(key, ours, theirs):
            continue
        if explicit(key):
            errors.append(Problem(key, f"{ours!r}, but the adapter in {p.adapter_path} has {name}={theirs!r}",
                                  where(key), f"set {key} to the adapter's value, or remove it"))
        else:
            warnings.append(Problem(key, f"the adapter's {name}={theirs!r} is trained (not overdrive's default "
                                    f"{ours!r})", here))
    base = saved.get("base_model_name_or_path")
    if base and cfg.model.name_or_path and Path(str(base)).name != Path(str(cfg.model.name_or_path)).name:
        warnings.append(Problem("model.name_or_path", f"{cfg.model.name_or_path}, but the adapter was trained on "
                                f"{base}", where("model.name_or_path"), "check that the two are the same model"))
    return errors, warnings
