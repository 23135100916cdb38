"""The commands a run's processes find on PATH: a virtual environment's own first."""

from __future__ import annotations

import os
import sys


def installed_tools_first() -> None:
    """In a virtual environment, put its commands first on PATH, as activating it does, for
    everything this run starts (a user's script under `overdrive launch` too: its `python`
    is the venv's).

    DeepSpeed builds its CPU ops (shared-memory collectives, CPU Adam) just in time with
    whichever `ninja` PATH finds. `.venv/bin/overdrive` run without activating the venv would
    find none on a machine without a system ninja (the load fails), or a system ninja of
    another version, whose build log hashes commands differently: every switch between the two
    rebuilds the op from scratch (35 to 80 s on two cores). Outside a venv (a system or
    `--user` install) the interpreter's directory is /usr/bin or the like, and putting it first
    would shadow ~/.local/bin: PATH is left as the user ordered it.
    """
    if sys.prefix == sys.base_prefix:
        return
    tools = os.path.dirname(sys.executable)
    path = os.environ.get("PATH") or os.defpath  # unset: what the shell's lookups fall back to
    if tools and path.split(os.pathsep)[0] != tools:
        os.environ["PATH"] = os.pathsep.join([tools, path])
