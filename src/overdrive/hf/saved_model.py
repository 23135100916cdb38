"""A trained model read back for `overdrive eval` and `overdrive generate`, and for a run's
evaluation when its model is sharded: a run's directory (its `model/`), a save_pretrained
directory, a PEFT adapter directory (loaded onto the base its adapter_config.json names), or a
hub name. The tokenizer comes from beside the weights (a run saves its own, chat template
included), else from the base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from overdrive.errors import Problem, UserError

# PEFT's task types and the Auto class that loads each one's base.
_AUTO = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification"}
KEY = "RUN_OR_MODEL"  # what the commands call the argument in their messages


@dataclass
class Loaded:
    model: Any  # a Transformers model, or a PeftModel over one
    tokenizer: Any
    what: str  # said to the user: the model, and the base under an adapter


def model_path(target: str) -> str:
    """A run's output_dir means its final model (`<run>/model`); anything else is itself."""
    path = Path(target).expanduser()
    if (path / "model").is_dir() and not (path / "config.json").is_file() and not is_adapter(path):
        return str(path / "model")
    return target


def is_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def load(target: str, *, dtype: str = "float32", device: Optional[str] = None, base: Optional[str] = None,
         key: str = KEY) -> Loaded:
    """The model (with its adapter applied) and tokenizer of `target`, in eval mode, on `device`."""
    import transformers

    from overdrive import hub

    name = model_path(target)
    path = Path(name).expanduser()
    hub.refuse_missing_local(key, name)
    if path.is_dir() and not is_adapter(path) and not (path / "config.json").is_file():
        raise UserError(Problem(key, f"{name} holds neither a model (config.json) nor an adapter "
                                "(adapter_config.json)", fix="give a run's output_dir, its model/ directory, "
                                "a save_pretrained directory or an adapter directory"))
    if path.is_dir() and is_adapter(path):
        model, tokenizer, base_name = load_adapter(path, base, dtype, key)
        what = f"{name} (adapter on {base_name})"
    else:
        with hub.reading(key, name):
            model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=_dtype(dtype))
        with hub.reading(key, name, what="tokenizer"):
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        what = name
    if device:
        model.to(device)
    model.eval()
    return Loaded(model, tokenizer, what)


def load_adapter(path: Path, base: Optional[str] = None, dtype: str = "float32", key: str = KEY
                 ) -> tuple[Any, Any, str]:
    """(PeftModel, tokenizer, base name): PEFT's adapter on its base (the one adapter_config.json
    names, or `base`), the base loaded in `dtype`, never quantized."""
    import transformers
    from peft import PeftModel

    from overdrive import hub
    from overdrive.hf.lora import adapter_config

    try:
        saved = adapter_config(str(path))
    except ValueError as error:
        raise UserError(Problem(key, str(error), fix="give a PEFT adapter directory (adapter_config.json and its "
                                "weights)")) from None
    base = base or saved.get("base_model_name_or_path")
    if not base:
        raise UserError(Problem("--base", f"the adapter in {path} does not name its base model",
                                fix="pass --base MODEL (a hub name or a save_pretrained directory)"))
    auto = getattr(transformers, _AUTO.get(str(saved.get("task_type") or "CAUSAL_LM"), "AutoModelForCausalLM"))
    with hub.reading("--base", base):
        model = auto.from_pretrained(base, dtype=_dtype(dtype))
    tokenizer_from = str(path) if (path / "tokenizer_config.json").is_file() else base
    with hub.reading("--base", tokenizer_from, what="tokenizer"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # tokens added while the adapter trained
    return PeftModel.from_pretrained(model, str(path)), tokenizer, str(base)


def _dtype(name: str) -> Any:
    import torch

    return "auto" if name == "auto" else getattr(torch, name)
