"""Checkpoint directories on disk: written whole or not at all, checked before use.

Layout under `<output_dir>/checkpoints/`:

    step-00000100/            a complete checkpoint (never written in place)
        manifest.json         every other file with its size and sha256, written last
        trainer_state.json    step, data position, config fingerprint (see session.py)
        model.safetensors ... whatever `accelerator.save_state` wrote (shards included)
    .tmp-step-00000200/       a save in progress, or one killed mid-way: never read

A save writes into the `.tmp-` directory, fsyncs every file, writes the manifest, fsyncs
it and the directory, and only then renames the directory to its final name
(`os.replace` within one file system is atomic) and fsyncs the parent. A reader therefore
sees either the whole checkpoint or nothing; a kill at any point leaves the previous
checkpoint untouched. Nothing here knows about torch: it is files, sizes and hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
ASIDE_PREFIX = ".corrupt-"  # a checkpoint that failed verification, kept for a look until a newer one is saved


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir).expanduser() / "checkpoints"


def name_for(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> Optional[int]:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def _listed_step(path: Path) -> int:
    """The step of a directory `candidates` listed (named as a checkpoint, so it has one)."""
    return step_of(path) or 0


# ---------------------------------------------------------------- durability

def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents to stable storage.

    A rename is only durable once the data it points at is: without this, a power loss
    right after the rename can leave a complete-looking directory of empty files.
    """
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # some file systems refuse to open directories: nothing more can be done
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            yield path


def write_manifest(directory: Path, step: int) -> dict:
    """Hash every file under `directory`, fsync it, then write and fsync the manifest.

    Reading each file back to hash it costs about a second per GB; it is what lets a resume
    tell a complete checkpoint from one truncated by a full disk or a dying node.
    """
    files = {}
    for path in _files(directory):
        fsync_path(path)
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files}
    target = directory / MANIFEST
    with target.open("w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in _files(directory)} | {directory}, key=lambda p: len(p.parts), reverse=True):
        fsync_path(sub)
    return manifest


# ---------------------------------------------------------------- the atomic directory

def temp_dir_for(root: Path, step: int) -> Path:
    return root / f"{TMP_PREFIX}{name_for(step)}"


def begin(root: Path, step: int) -> Path:
    """An empty temporary directory for the checkpoint of `step` (a stale one is removed:
    it can only be the remains of a save that was killed)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int) -> Path:
    """Seal `tmp` with its manifest and make it visible under its final name, atomically.

    A directory of the same name (left by an earlier run in this output_dir, or a
    checkpoint that failed verification) is moved aside first and deleted afterwards, so at
    every instant either it or the new checkpoint is complete.
    """
    write_manifest(tmp, step)
    final = tmp.parent / name_for(step)
    old = None
    if final.exists():
        old = tmp.parent / f"{TRASH_PREFIX}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------- reading

@dataclass
class Verdict:
    path: Path
    step: int
    ok: bool
    reason: str = ""
    aside: Optional[Path] = None  # where it was moved, when set aside


def verify(path: Path, checksums: bool = True) -> Verdict:
    """Is `path` a complete checkpoint? Structure always; sha256 of every file if `checksums`.

    Structure: the manifest parses, names the same step as the directory, and every file
    it lists exists with the listed size. Files not in the manifest are ignored (a
    checkpoint is what its manifest says).
    """
    step = step_of(path)
    if step is None:
        return Verdict(path, -1, False, "not a checkpoint directory name")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return Verdict(path, step, False, "no manifest.json (the save did not finish)")
    except (OSError, ValueError, KeyError, TypeError) as error:
        return Verdict(path, step, False, f"unreadable manifest.json ({error})")
    if manifest.get("step") != step:
        return Verdict(path, step, False, f"manifest is for step {manifest.get('step')}, not {step}")
    for rel, entry in sorted(files.items()):
        file = path / rel
        try:
            size = file.stat().st_size
        except OSError:
            return Verdict(path, step, False, f"{rel} is missing")
        if size != entry["size"]:
            return Verdict(path, step, False, f"{rel} has {size} bytes, the manifest says {entry['size']}")
    if checksums:
        for rel, entry in sorted(files.items()):
            if sha256_of(path / rel) != entry["sha256"]:
                return Verdict(path, step, False, f"{rel} does not match its sha256 (corrupted)")
    return Verdict(path, step, True)


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories (final names only), newest step first."""
    if not root.is_dir():
        return []
    found = {p: step for p in root.iterdir() if p.is_dir() and (step := step_of(p)) is not None}
    return sorted(found, key=found.__getitem__, reverse=True)


@dataclass
class Search:
    """The newest checkpoint that passed, and every newer one that did not (with why)."""

    found: Optional[Verdict] = None
    skipped: list[Verdict] = field(default_factory=list)

    def messages(self) -> list[str]:
        return [f"skipping {v.path.name}: {v.reason}" + (f"; set aside as {v.aside.name}" if v.aside else "")
                for v in self.skipped]


def latest_complete(root: Path, checksums: bool = True, at_most: Optional[int] = None,
                    put_aside: bool = False) -> Search:
    """The newest complete checkpoint under `root` (optionally with step <= `at_most`); with
    `put_aside`, the newer ones that fail verification are set aside (a run about to resume)."""
    search = Search()
    for path in candidates(root):
        if at_most is not None and _listed_step(path) > at_most:
            continue
        verdict = verify(path, checksums)
        if verdict.ok:
            search.found = verdict
            return search
        if put_aside:
            verdict.aside = set_aside(verdict)
        search.skipped.append(verdict)
    return search


def size_of(path: Path) -> Optional[int]:
    """Bytes of a complete checkpoint, from its manifest."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        return sum(int(entry["size"]) for entry in files.values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def set_aside(verdict: Verdict) -> Optional[Path]:
    """Move a checkpoint that failed verification out of the way (a hidden name, so no resume
    tries it again); removed by `prune` once a newer checkpoint is saved."""
    target = verdict.path.parent / f"{ASIDE_PREFIX}{verdict.path.name}"
    try:
        if target.exists():
            shutil.rmtree(target)
        os.replace(verdict.path, target)
    except OSError:  # a read-only disk: it stays where it is, and is skipped again next time
        return None
    return target


# ---------------------------------------------------------------- pruning

def _remove(path: Path) -> None:
    # Renamed first: a deletion interrupted half-way leaves a hidden name, not a
    # checkpoint directory with some of its files gone.
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.replace(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: Path, keep_last: int, current_step: int,
          belongs: Optional[Callable[[Path], bool]] = None) -> list[Path]:
    """After a successful save of `current_step`: keep the newest `keep_last` checkpoints.

    Removed as well: checkpoints of later steps than the one just saved, and (with
    `belongs`) those of another run. They belong to a future this run has abandoned (a
    fresh start in the same output_dir, or a resume that skipped a corrupt checkpoint), and
    a later resume must not jump into them. Leftover temporary and trash directories
    (saves or deletions that were killed) go too.
    """
    removed = []
    kept = 0
    for path in candidates(root):
        if _listed_step(path) > current_step or kept >= keep_last or (belongs is not None and not belongs(path)):
            _remove(path)
            removed.append(path)
        else:
            kept += 1
    for path in root.iterdir():
        aside = path.name.startswith(ASIDE_PREFIX)
        if aside and (step_of(Path(path.name[len(ASIDE_PREFIX):])) or 0) > current_step:
            continue  # not yet superseded by a newer checkpoint
        if (aside or path.name.startswith((TMP_PREFIX, TRASH_PREFIX))) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    return removed


def truncate(path: Path, size: int) -> None:
    """Cut a log back to `size` bytes (what it held when the checkpoint was taken)."""
    try:
        if path.stat().st_size > size:
            with path.open("r+b") as f:
                f.truncate(size)
    except FileNotFoundError:
        pass
