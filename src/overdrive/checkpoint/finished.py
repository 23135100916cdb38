"""A run rerun after it finished: said complete, with where its model is, instead of loading
everything to train zero steps ("resumed from step-20", "0 tokens/s")."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from overdrive.checkpoint import store
from overdrive.checkpoint.resume import read_state, saved_config
from overdrive.errors import UserError
from overdrive.resolving import Resolved


def finished(resolved: Resolved) -> Optional[str]:
    """The sentence for a run whose judged checkpoint is at its last step (and whose final model,
    when it saves one, is there), or None when there is training left to do."""
    record, cfg = resolved.resume or {}, resolved.config
    if not record.get("checkpoint"):
        return None
    path = Path(record["checkpoint"])
    if not store.verify(path, checksums=False).ok:
        return None  # cut short since: the run sets it aside and resumes from the one before
    try:
        saved = read_state(path)
        step, training = int(saved["step"]), saved_config(saved, path).training
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None  # the run judges it again, and says what is wrong
    wanted = cfg.training.max_steps
    if wanted is None:  # the length is counted from the data: the same epochs as the run that finished
        if training.num_epochs != cfg.training.num_epochs:
            return None
        wanted = training.max_steps
    if not wanted or step < wanted:
        return None
    out = Path(cfg.output_dir)
    model = out / "model"
    if cfg.checkpoint.save_final_model and not model.is_dir():
        return None  # its end did not finish: the run saves it again
    where = f"its model is {model}" if cfg.checkpoint.save_final_model else f"its last checkpoint is {path}"
    return (f"the run in {out} is complete: step {step} of {wanted} ({path.name}); {where}. "
            "Nothing to train: raise training.max_steps to train further, or give a new output_dir to start another")
