"""Room for this run's checkpoints: said before the first step, checked before each save.

The size of a checkpoint is estimated from the model's parameters until the run has saved
one (or resumes from one), then measured. A save that may not fit is warned about and
tried; a failure mid-way removes what it wrote (agreed.py) and ends the run with the
message of storage/faults.py (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from overdrive.checkpoint import store
from overdrive.checkpoint.agreed import SaveParts
from overdrive.config.schema import RunConfig
from overdrive.storage import space


def parameters(models: Sequence[Any]) -> int:
    """Parameters of the prepared models, counted once (a ZeRO-3 parameter's size is `ds_numel`)."""
    seen, total = set(), 0
    for model in models:
        for param in model.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += getattr(param, "ds_numel", None) or param.numel()
    return total


def planned(cfg: RunConfig, parameters: int) -> space.Room:
    """For `plan`, before the run: the newest checkpoint in output_dir measured, else the estimate."""
    root = store.checkpoints_dir(cfg.output_dir)
    found = store.latest_complete(root, checksums=False).found
    size = store.size_of(found.path) if found is not None else None
    per_checkpoint = size if size is not None else space.estimated_checkpoint_bytes(parameters)
    return space.room(root, per_checkpoint, cfg.checkpoint.keep_last, measured=size is not None,
                      existing=len(store.candidates(root)))


class CheckpointRoom:
    def __init__(self, cfg: RunConfig, root: Path, models: Sequence[Any], resumed: Optional[Path] = None):
        self.root, self.keep_last = root, cfg.checkpoint.keep_last
        size = store.size_of(resumed) if resumed is not None else None
        self.is_measured = size is not None
        self.per_checkpoint = size if size is not None else space.estimated_checkpoint_bytes(parameters(models))

    def room(self) -> space.Room:
        return space.room(self.root, self.per_checkpoint, self.keep_last, self.is_measured,
                          existing=len(store.candidates(self.root)))

    def warn_early(self, say: Callable[[str], None]) -> None:
        warning = self.room().warning()
        if warning:
            say(f"checkpoint: warning: {warning}")

    @property
    def hint(self) -> str:
        return f"lower checkpoint.keep_last (now {self.keep_last})" if self.keep_last > 1 else ""

    def save_parts(self, accelerator: Any, tmp: Path, step: int) -> SaveParts:
        return SaveParts(accelerator, tmp, f"the checkpoint of step {step}", self.per_checkpoint, self.hint)

    def check_then_begin(self, step: int, say: Callable[[str], None]) -> None:
        """Main process: warn when this save or the next may not fit, then make the temp directory.
        The save is still tried (a size is a forecast; space may have been freed meanwhile): a
        failure removes what it wrote and ends the run with the one message."""
        room = self.room()
        if not room.next_fits:
            say(f"checkpoint: warning: step {step} may not fit: {room.summary()}")
        elif room.tight:
            say(f"checkpoint: warning: {room.warning()}")
        store.begin(self.root, step)

    def measured(self, final: Path) -> None:
        size = store.size_of(final)
        if size is not None:
            self.per_checkpoint, self.is_measured = size, True
