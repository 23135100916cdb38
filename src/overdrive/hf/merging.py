"""A PEFT adapter merged into its base, without a run: `overdrive merge ADAPTER -o DIR`.

The base is the adapter's own `base_model_name_or_path` (PEFT writes it into
adapter_config.json) or the one given; it is loaded in full precision, never quantized and
never written to; PEFT's `merge_and_unload` folds the adapter into its weights, and the result
is saved with save_pretrained, loadable by the Auto class of the adapter's task, with the
tokenizer saved beside the adapter (or the base's).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from overdrive.errors import Problem, UserError

_AUTO = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification"}


def read_adapter(adapter: Path) -> dict:
    """The adapter's adapter_config.json, or a refusal by ADAPTER."""
    from overdrive.hf.lora import adapter_config

    try:
        return adapter_config(str(adapter))
    except ValueError as error:
        raise UserError(Problem("ADAPTER", str(error), fix="give a PEFT adapter directory (adapter_config.json and "
                                "its weights)")) from None


def base_of(adapter: Path, given: Optional[str]) -> tuple[str, str]:
    """The base to merge into and the key that named it: --base, or the adapter's own
    base_model_name_or_path (a relative path read from the adapter's directory)."""
    from overdrive.hf.adapter_fit import stored_base

    if given:
        return given, "--base"
    base, how = stored_base(adapter, read_adapter(adapter))
    if not base:
        raise UserError(Problem("--base", f"the adapter in {adapter} does not name its base model",
                                fix="pass --base MODEL (a hub name or a save_pretrained directory)"))
    return base, f"base_model_name_or_path in {adapter / 'adapter_config.json'}" + (f" ({how})" if how else "")


def merge(adapter: Path, target: Path, base: Optional[str] = None, dtype: str = "float32") -> str:
    """Write the merged model to `target`; the base it was merged into is returned."""
    import torch
    import transformers
    from peft import PeftModel

    from overdrive.hf.adapter_fit import fit_problems, model_type_problems
    from overdrive.hub import reading

    saved = read_adapter(adapter)
    base, key = base_of(adapter, base)
    task = str(saved.get("task_type") or "CAUSAL_LM")
    auto = getattr(transformers, _AUTO.get(task, "AutoModelForCausalLM"))
    try:
        with reading(key, base):
            model = auto.from_pretrained(base, dtype=getattr(torch, dtype) if dtype != "auto" else "auto")
    except UserError as error:
        if key == "--base":
            raise
        # The base came from adapter_config.json: the way out the user has is --base.
        raise UserError([replace(p, fix=f"pass --base DIR (the base the adapter was trained on); or {p.fix}")
                         for p in error.problems], title=error.title) from None
    named = "--base" if key == "--base" else "ADAPTER"
    problems = model_type_problems(model, adapter, saved, named, base) or \
        fit_problems(model, adapter, named, f"{base} (from {key})")
    if problems:
        raise UserError(problems)
    tokenizer_from = adapter if (adapter / "tokenizer_config.json").is_file() else base
    with reading(key, str(tokenizer_from)):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # tokens added while the adapter trained
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(base)
