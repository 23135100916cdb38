"""Cross-field rules of fine-tuning: `peft.*` against the model, data and strategy.

What needs the model's structure (which module names `peft.target_modules` matches) is
checked where the model is known, by training/build/adapter.py; these rules need the config alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Callable, Mapping

from overdrive.config.keys import differs_from_default
from overdrive.errors import Problem
from overdrive.strategies import adapter as strategy_adapter

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# bitsandbytes has 4-bit and 8-bit layers on the CPU from 0.46 on (its CPU backend); the
# QLoRA path was checked here with 0.50 (training, saving, merging).
BNB_CPU_SINCE = (0, 46)
_CHAT_KEYS = ("data.messages_column", "data.prompt_column", "data.completion_column", "data.train_on_prompt",
              "data.overlong", "data.packing", "tokenizer.chat_template")


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def bitsandbytes_problem(on_cpu: bool) -> str:
    """Why qlora cannot run here ("" when it can)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs bitsandbytes, which is not installed"
    if on_cpu and _version(importlib.metadata.version("bitsandbytes")) < BNB_CPU_SINCE:
        return (f"needs bitsandbytes >= {'.'.join(map(str, BNB_CPU_SINCE))} to train on the CPU (its CPU backend); "
                f"{importlib.metadata.version('bitsandbytes')} is installed")
    return ""


def peft_rules(cfg: RunConfig, where, set_explicitly: Mapping[str, bool], on_cpu: Callable[[], bool]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings). `where(key)` says where a value was set; `set_explicitly[key]` whether
    a layer above the defaults set it; `on_cpu()` whether the run trains on the CPU."""
    errors, warnings = [], []
    p = cfg.peft
    if p.method == "none":
        stray = [k for k, v in set_explicitly.items() if v and k.startswith("peft.") and k != "peft.method"]
        if stray:
            warnings.append(Problem(stray[0], "has no effect while peft.method is none (every parameter is trained)",
                                    where(stray[0]), "set peft.method=lora (or qlora) to train an adapter"))
    else:
        if not cfg.model.name_or_path or cfg.model.from_scratch:
            errors.append(Problem("peft.method", f"{p.method} adapts pretrained weights, but the model starts from "
                                  "random ones", where("peft.method"),
                                  "set model.name_or_path to a save_pretrained directory (or hub name), without "
                                  "model.from_scratch; or peft.method=none"))
        errors += strategy_adapter.problems(cfg, where)  # what the strategy cannot do with this adapter
        if isinstance(p.target_modules, list) and not [m for m in p.target_modules if str(m).strip()]:
            errors.append(Problem("peft.target_modules", "is empty: the adapter would wrap no layer",
                                  where("peft.target_modules"), "name the layers (e.g. [q_proj, v_proj]), or "
                                  "all-linear"))
        if p.method == "qlora":
            why = bitsandbytes_problem(on_cpu())
            if why:
                errors.append(Problem("peft.method", f"qlora {why}", where("peft.method"),
                                      "pip install 'bitsandbytes>=0.46', or use peft.method=lora"))
    if cfg.data.format in ("chat", "preference"):
        if cfg.model.task != "causal-lm" and cfg.data.format == "chat":
            errors.append(Problem("data.format", f"{cfg.data.format} data trains a causal LM", where("data.format"),
                                  "set model.task=causal-lm, or another data.format"))
        if not (cfg.tokenizer.name_or_path or cfg.model.name_or_path):
            errors.append(Problem("tokenizer.name_or_path", "chat data is rendered by a pretrained tokenizer's chat "
                                  "template; a tokenizer trained on the fly has none", where("data.format"),
                                  "set model.name_or_path (or tokenizer.name_or_path)"))
    else:
        stray = [k for k in _CHAT_KEYS if set_explicitly.get(k)]
        # Never accepted with no effect: a value that would change a chat run, on data declared not to be
        # chat, is refused; with data.format=auto the rows decide, so it is only said.
        refused = [k for k in stray if cfg.data.format != "auto" and differs_from_default(cfg, k)]
        for key in refused:
            errors.append(Problem(key, f"applies to chat data only (data.format is {cfg.data.format}): it would "
                                  "change nothing", where(key), f"set data.format=chat, or leave {key} out"))
        if stray and not refused:
            warnings.append(Problem(stray[0], "applies to chat data only (data.format is "
                                    f"{cfg.data.format})", where(stray[0]), "set data.format=chat"))
    return errors, warnings
