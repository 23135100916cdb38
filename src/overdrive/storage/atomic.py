"""A directory written whole or not at all: written beside its final name, then renamed.

For outputs a run writes once at its end (the final `save_pretrained` model): a failure
half-way (a full disk) removes the partial copy and leaves the previous one as it was.
Checkpoints have their own, with manifests and fsyncs (checkpoint/store.py).
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from overdrive.storage.faults import writing


@contextmanager
def directory(target: Path, key: str, what: str) -> Iterator[Path]:
    """Yields a temporary sibling of `target` to write into; on success it becomes `target`."""
    target = Path(target)
    tmp = target.with_name(f".tmp-{target.name}")
    with writing(target, key, what=what):
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            yield tmp
            old = target.with_name(f".old-{target.name}-{os.getpid()}-{time.monotonic_ns()}")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
