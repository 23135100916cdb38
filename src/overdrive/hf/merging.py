"""A PEFT adapter merged into its base, without a run: `overdrive merge ADAPTER -o DIR`.

The base is the adapter's own `base_model_name_or_path` (PEFT writes it into
adapter_config.json) or the one given; it is loaded in full precision, never quantized and
never written to (hf/saved_model.load_adapter, the one reader of an adapter on its base); PEFT's
`merge_and_unload` folds the adapter into its weights, and the result is saved with
save_pretrained, loadable by the Auto class of the adapter's task, with the tokenizer saved
beside the adapter (or the base's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def merge(adapter: Path, target: Path, base: Optional[str] = None, dtype: str = "float32") -> str:
    """Write the merged model to `target`; the base it was merged into is returned."""
    from overdrive.hf.saved_model import load_adapter

    model, tokenizer, base_name = load_adapter(adapter, base, dtype, key="ADAPTER")
    merged = model.merge_and_unload()
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return base_name
