"""A small file replaced whole or not at all: the one way overdrive rewrites a record that
another process may be reading (a heartbeat, a cache entry, a trial's values, resolved.json).

Written beside its name under a name of this process's own (so writers never share one), then
renamed over it: a reader sees the old content or the new, never half. A symbolic link is
followed, so the file it points at is replaced, not the link. An OSError leaves the previous
file as it was and reaches the caller, which decides whether it matters (storage/faults.py's
`write_text` turns it into the message a user reads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union


def replace_whole(path: Union[str, Path], text: str, durable: bool = False) -> Path:
    """`text` as the file at `path`, whole; `durable`: on the disk before the rename (fsync), for
    records that must survive a machine's crash. Returns the file written."""
    path = Path(path)
    final = path.resolve() if path.is_symlink() else path
    temporary = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if durable:
            with open(temporary, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            temporary.write_text(text)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    return final
