"""A trained model read back for `overdrive eval` and `overdrive generate`, and for a run's
evaluation when its model is sharded: a run's directory (its `model/`), a save_pretrained
directory, a PEFT adapter directory (loaded onto the base its adapter_config.json names), or a
hub name. The tokenizer comes from beside the weights (a run saves its own, chat template
included), else from the base.
"""

from __future__ import annotations

from dataclasses import replace

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

    # Transformers' "Loading weights" bar says nothing about the answer or the scores that follow.
    transformers.utils.logging.disable_progress_bar()

    name = model_path(target)
    path = Path(name).expanduser()
    hub.refuse_missing_local(key, name)
    if path.is_dir() and not is_adapter(path) and not (path / "config.json").is_file():
        raise UserError(Problem(key, f"{name} holds neither a model (config.json) nor an adapter "
                                "(adapter_config.json)", fix="give a run's output_dir, its model/ directory, "
                                "a save_pretrained directory or an adapter directory"))
    _refuse_vision(path, base, key)
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


def _refuse_vision(path: Path, base: Optional[str], key: str) -> None:
    """A vision-language model (or an adapter on one) answers questions about images, which `overdrive eval`
    does not give it: refused by key rather than loaded as a text model (`generate` loads it through
    hf/vision_generate.py first)."""
    import json

    from overdrive.hf.vision import config_is_vision

    config = path / "config.json"
    if path.is_dir() and is_adapter(path):
        named = base or json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        config = Path(named).expanduser() / "config.json"
    try:
        vision = config.is_file() and config_is_vision(json.loads(config.read_text()))
    except (OSError, ValueError):
        return
    if vision:
        raise UserError(Problem(key, f"{path} is a vision-language model (or an adapter on one); this command gives "
                                "it no images", fix="ask it about images with `overdrive generate RUN \"question\" "
                                "--image PATH`, or load it with AutoModelForImageTextToText and its processor "
                                "(docs/vision.md)"))


def adapter_base(path: Path, given: Optional[str] = None, key: str = KEY) -> tuple[str, str, dict]:
    """(the base, what named it, adapter_config.json) of an adapter: `given` (--base), or the
    adapter's own base_model_name_or_path, a relative path read from the adapter's directory."""
    from overdrive.hf.adapter_fit import stored_base
    from overdrive.hf.lora import adapter_config

    try:
        saved = adapter_config(str(path))
    except ValueError as error:
        raise UserError(Problem(key, str(error), fix="give a PEFT adapter directory (adapter_config.json and its "
                                "weights)")) from None
    if given:
        return given, "--base", saved
    base, how = stored_base(path, saved)
    if not base:
        raise UserError(Problem("--base", f"the adapter in {path} does not name its base model",
                                fix="pass --base MODEL (a hub name or a save_pretrained directory)"))
    return base, f"base_model_name_or_path in {path / 'adapter_config.json'}" + (f" ({how})" if how else ""), saved


def load_adapter(path: Path, base: Optional[str] = None, dtype: str = "float32", key: str = KEY
                 ) -> tuple[Any, Any, str]:
    """(PeftModel, tokenizer, base name): PEFT's adapter on its base (the one adapter_config.json
    names, or `base`), the base loaded in `dtype`, never quantized."""
    import transformers
    from peft import PeftModel

    from overdrive import hub
    from overdrive.hf.adapter_fit import fit_problems, model_type_problems

    base, named_by, saved = adapter_base(path, base, key)
    given = named_by == "--base"
    auto = getattr(transformers, _AUTO.get(str(saved.get("task_type") or "CAUSAL_LM"), "AutoModelForCausalLM"))
    try:
        with hub.reading(named_by, base):
            model = auto.from_pretrained(base, dtype=_dtype(dtype))
    except UserError as error:
        if given:
            raise
        # The base came from adapter_config.json: the way out the user has is --base.
        raise UserError([replace(p, fix=f"pass --base DIR (the base the adapter was trained on); or {p.fix}")
                         for p in error.problems], title=error.title) from None
    named = "--base" if given else key
    problems = (model_type_problems(model, path, saved, named, base)
                or fit_problems(model, path, named, f"{base} (from {named_by})"))
    if problems:  # an adapter of another base: refused naming both, not PEFT's state-dict error
        raise UserError(problems)
    tokenizer_from = str(path) if (path / "tokenizer_config.json").is_file() else base
    with hub.reading("--base", tokenizer_from, what="tokenizer"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # tokens added while the adapter trained
    return PeftModel.from_pretrained(model, str(path)), tokenizer, str(base)


def _dtype(name: str) -> Any:
    import torch

    return "auto" if name == "auto" else getattr(torch, name)
