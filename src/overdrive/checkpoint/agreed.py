"""A save written by every rank, failed by any: all ranks learn it at the same point and stop.

Each part of a save (make the temp directory, `save_state`, the trainer's state, the
manifest and rename) runs on its ranks, then every rank says whether its part failed
(`gather_object`, a collective every rank reaches, which also orders the parts as the
barriers did). On a failure the half-written temp directory is removed, the previous
checkpoints stay as they were, and every rank raises: the rank that failed with the one
message for its fault (storage/faults.py), the others naming that rank. No rank is left
waiting in a collective the failed one will never enter.

A collective inside a library's own save (DeepSpeed's, DCP's) that a failing rank leaves is
beyond this: there the process-group timeout, or the launcher stopping the job when the
failed rank exits, ends the others.
"""

from __future__ import annotations

import shutil
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.errors import Problem, UserError
from overdrive.storage import faults


class SaveParts:
    """Runs the parts of one checkpoint save on every rank, agreeing after each."""

    def __init__(self, accelerator: Any, tmp: Path, what: str, needed: Optional[int], hint: str):
        self.acc, self.tmp, self.what, self.needed, self.hint = accelerator, tmp, what, needed, hint

    def part(self, write: Callable[[], Any]) -> None:
        error: Optional[BaseException] = None
        try:
            write()
        except Exception as caught:  # judged below, after every rank has said how its part went
            error = caught
        # Decided before the partial files go: torch's writer gives no errno, the free space tells.
        number = faults.fault_errno(error, self.tmp) if error is not None else None
        if error is not None:
            # The failed writer's open files live in the traceback's frames: closed now, so the
            # space they hold is free before the message measures it.
            traceback.clear_frames(error.__traceback__)
        failed = self._failed_ranks(error is not None)
        if not failed:
            return
        if self.acc.is_main_process or self.acc.is_local_main_process:
            shutil.rmtree(self.tmp, ignore_errors=True)  # the half-written save, not the checkpoints before it
        if error is None:
            raise UserError(Problem("output_dir", f"rank {failed[0]} could not write {self.what}; its message says "
                                    "why (the previous checkpoint is kept)"))
        if isinstance(error, UserError):
            raise error
        mapped = faults.explain(error, self.tmp, "output_dir", what=self.what, needed=self.needed, hint=self.hint,
                                number=number)
        if mapped is None:
            raise error
        raise mapped from None

    def _failed_ranks(self, failed_here: bool) -> list[int]:
        if self.acc.num_processes == 1:
            return [0] if failed_here else []
        from accelerate.utils import gather_object

        flags = gather_object([failed_here])
        return [rank for rank, flag in enumerate(flags) if flag]
