"""Room on disk for checkpoints: how big one will be, whether the next fits, said early.

A checkpoint holds the weights and the optimizer's state: for AdamW in fp32, the weights
and two moments, 12 bytes per parameter (the model files are fp32 here; RNG states and the
trainer's json are kilobytes). Once a run has saved, the size of its last checkpoint is
measured instead. While a save is written the previous `checkpoint.keep_last` stay, so
`keep_last + 1` checkpoints are on disk at the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from overdrive.storage.faults import file_system, mb

BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq
SMALL_FILES = 1 << 20  # RNG states, trainer_state.json, manifest


def estimated_checkpoint_bytes(parameters: int) -> int:
    return parameters * BYTES_PER_PARAMETER + SMALL_FILES


@dataclass(frozen=True)
class Room:
    """Free space against what the checkpoints will take."""

    path: Path
    free: Optional[int]
    per_checkpoint: int
    keep_last: int
    measured: bool  # per_checkpoint is a saved checkpoint's size, not an estimate
    existing: int = 0  # checkpoints already on the disk (their space is not in `free`)

    @property
    def peak(self) -> int:
        return self.per_checkpoint * (self.keep_last + 1)

    @property
    def still_needed(self) -> int:
        """What the run's checkpoints will take beyond what is already on the disk, at their peak."""
        return self.per_checkpoint * (self.keep_last + 1 - min(self.existing, self.keep_last))

    @property
    def next_fits(self) -> bool:
        return self.free is None or self.free >= self.per_checkpoint

    @property
    def tight(self) -> bool:
        return self.free is not None and self.free < self.still_needed

    def summary(self) -> str:
        how = "measured" if self.measured else "estimated"
        fs = file_system(self.path)
        return (f"{mb(self.per_checkpoint)} per checkpoint ({how}), up to {mb(self.peak)} with keep_last="
                f"{self.keep_last} while a save is written; {mb(self.free)} free on {fs.mount} ({fs.kind})")

    def warning(self) -> Optional[str]:
        """A line to print when the space may run out during the run, else None."""
        if self.free is None or self.free >= self.still_needed:
            return None
        saves = self.free // max(self.per_checkpoint, 1)
        return (f"only {mb(self.free)} free on {file_system(self.path).mount} for checkpoints of "
                f"~{mb(self.per_checkpoint)}: room for {saves} more; free space, lower checkpoint.keep_last "
                f"(now {self.keep_last}) or set output_dir to a disk with room")


def room(path: Union[str, Path], per_checkpoint: int, keep_last: int, measured: bool = False,
         existing: int = 0) -> Room:
    return Room(Path(path), file_system(path).free, per_checkpoint, keep_last, measured, existing)
