"""A write that meets a full disk, a quota, a read-only or failing file system, or a missing
permission: one message naming the path, its file system, the space needed and free, and
the key to change. Every write overdrive makes goes through `writing(...)` or reaches the
command boundary, which asks `as_user_error(...)`: this is the one place that reads errnos.

Libraries do not always say ENOSPC: safetensors reports `IoError(Os { code: 28 ... })` in a
string, and torch's zip writer ends with `[enforce fail at inline_container.cc] unexpected pos`
without an errno at all. Those are recognised by their text, and a torch writer failure is
judged by the free space left on the file system it was writing to.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

from overdrive.errors import Problem, UserError

WRITE_FAULTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an input/output error (the disk or the network file system failed)",
}
_FULL = (errno.ENOSPC, errno.EDQUOT)
# Errnos written into library messages: Rust's io::Error (safetensors, tokenizers), Python's.
_ERRNO_IN_TEXT = (re.compile(r"Os \{ code: (\d+)"), re.compile(r"os error (\d+)"), re.compile(r"\[Errno (\d+)\]"))
_TEXT_FAULTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                "Read-only file system": errno.EROFS, "Input/output error": errno.EIO}
# torch.save's zip writer fails with these (no errno): decided by the free space left.
_TORCH_WRITER = ("PytorchStreamWriter failed", "unexpected pos", "file write failed")
_ALMOST_FULL = 1 << 20  # under a MiB free after a failed write: it was the space


@dataclass(frozen=True)
class FileSystem:
    """The file system holding a path: where it is mounted, its type, its space."""

    mount: str
    kind: str
    free: Optional[int]
    total: Optional[int]

    def describe(self) -> str:
        space = f", {mb(self.free)} free of {mb(self.total)}" if self.free is not None and self.total else ""
        return f"{self.kind} file system mounted at {self.mount}{space}"


def mb(size: Optional[float]) -> str:
    if size is None:
        return "unknown"
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def nearest_existing(path: Union[str, Path]) -> Path:
    path = Path(path).expanduser().absolute()
    while not _exists(path) and path.parent != path:
        path = path.parent
    return path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a folder that cannot be searched, a name too long
        return False


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file-system type) of every mount this process sees (Linux /proc)."""
    found: list[tuple[str, str]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        mount = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        found.append((mount, fields[dash + 1]))
    return found


def file_system(path: Union[str, Path]) -> FileSystem:
    """Mount point, type and space of the file system `path` is (or would be) on."""
    here = nearest_existing(path)
    try:
        real = os.path.realpath(here)
        usage = shutil.disk_usage(real)
        free, total = usage.free, usage.total
    except OSError:
        real, free, total = str(here), None, None
    best = ("/", "unknown")
    for mount, kind in _mounts():  # the last mount on the longest matching point is the one in effect
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
            best = (mount, kind)
    return FileSystem(best[0], best[1], free, total)


def free_bytes(path: Union[str, Path]) -> Optional[int]:
    return file_system(path).free


def _chain(error: Optional[BaseException]) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def fault_errno(error: BaseException, path: Union[str, Path, None] = None) -> Optional[int]:
    """The errno of a write fault somewhere in `error`'s chain, else None. A torch writer failure
    without one counts as ENOSPC when `path`'s file system is (nearly) full, else as EIO."""
    torch_writer = False
    for item in _chain(error):
        if isinstance(item, OSError) and item.errno in WRITE_FAULTS:
            return item.errno
        text = str(item)
        for pattern in _ERRNO_IN_TEXT:
            match = pattern.search(text)
            if match and int(match.group(1)) in WRITE_FAULTS:
                return int(match.group(1))
        for phrase, number in _TEXT_FAULTS.items():
            if phrase in text:
                return number
        torch_writer = torch_writer or any(phrase in text for phrase in _TORCH_WRITER)
    if torch_writer and path is not None:
        free = free_bytes(path)
        return errno.ENOSPC if free is not None and free < _ALMOST_FULL else errno.EIO
    return None


# The kernel's own file systems: no permission makes them a place for files.
_PSEUDO = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs", "devpts", "configfs", "pstore", "bpf"}


def _fix(number: int, key: str, fs: FileSystem, folder: Path, hint: str) -> str:
    # A key names a directory (output_dir, data.cache_dir); an option (--plot, -o) a file.
    place = "a path" if key.startswith("-") else "a directory"
    elsewhere = f"set {key} to {place} on another disk" if key else "write somewhere else"
    if fs.kind in _PSEUDO:
        return f"{fs.mount} is the kernel's {fs.kind} file system, not a disk: " + (
            f"set {key} to {place} on a disk" if key else "write somewhere else")
    if number in (errno.EACCES, errno.EPERM):
        return f"give this user write permission on {folder}, or set {key} to {place} you can write" if key \
            else f"give this user write permission on {folder}, or write somewhere else"
    if number in _FULL:
        text = f"free space on {fs.mount}" + (" or raise the quota" if number == errno.EDQUOT else "")
        text += f", {hint}" if hint else ""
        return f"{text}, or {elsewhere}"
    if number == errno.EROFS:
        return f"{fs.mount} is mounted read-only: {elsewhere}, or remount it read-write"
    return f"check the disk or network mount at {fs.mount} (the kernel log says more), then run again; or {elsewhere}"


def explain(error: BaseException, path: Union[str, Path, None], key: str = "", *, what: str = "",
            needed: Optional[int] = None, hint: str = "", number: Optional[int] = None) -> Optional[UserError]:
    """The UserError for a write fault, or None when `error` is not one.

    `path`: what was being written; `key`: the setting that chose the place (`output_dir`,
    `data.cache_dir`); `what`: a few words ("the checkpoint of step 10"); `needed`: bytes the
    write needs; `hint`: a further way out (`lower checkpoint.keep_last (now 3)`).
    """
    number = number or fault_errno(error, path)
    if number is None:
        return None
    path = Path(path or getattr(error, "filename", None) or ".").expanduser()
    fs = file_system(path)
    folder = nearest_existing(path)
    need = f"; {what or 'it'} needs ~{mb(needed)}" if needed and number in _FULL else ""
    message = (f"cannot write {what + ' in ' if what else ''}{path}: {WRITE_FAULTS[number]} "
               f"({fs.describe()}{need})")
    return UserError(Problem(key, message, fix=_fix(number, key, fs, folder, hint)),
                     title=f"cannot write {what or path}")


@contextmanager
def writing(path: Union[str, Path], key: str, *, what: str = "", needed: Optional[int] = None,
            hint: str = "") -> Iterator[None]:
    """Writes to `path` inside: a write fault becomes the one message (see `explain`)."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        mapped = explain(error, path, key, what=what, needed=needed, hint=hint)
        if mapped is None:
            raise
        raise mapped from None


def writable_target(path: Union[str, Path], name: str, *, directory: bool = False) -> Path:
    """Refuse, before any work, a place that cannot be written: a file where a directory is
    wanted (or the reverse), a path under a file, or a directory that cannot be created or
    written into (tried for real: permission bits do not tell for root or special file systems).
    The directory (for a file: its parent) exists afterwards."""
    import tempfile

    path = Path(path).expanduser()
    if "\0" in str(path):
        raise UserError(Problem(name, f"{str(path)!r} contains a NUL byte, which no file name can hold",
                                fix="give a plain path"))
    folder = path if directory else path.parent
    try:
        if directory and path.exists() and not path.is_dir():
            raise UserError(Problem(name, f"{path} is a file, not a directory", fix="choose a directory path"))
        if not directory and path.is_dir():
            raise UserError(Problem(name, f"{path} is a directory, not a file", fix="give a file name inside it"))
        if not directory and path.is_symlink() and not path.exists():
            raise UserError(Problem(name, f"{path} is a symbolic link to {os.readlink(path)}, which does not exist",
                                    fix="remove the link or give another path"))
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        # A write fault (read-only, permission, full, quota, EIO) with its file system and way out.
        raise explain(error, path, name) or UserError(Problem(name, f"cannot write {path}: {error.strerror or error}",
                                                              fix="choose a place you can write to")) from None
    return path


def keep_existing_files(paths: Iterable[Union[str, Path, None]], force: bool) -> None:
    """Refuse, before any work, to write over files the user already has, unless --force."""
    # A directory is not overwritten: `writable_target` refuses it as a file target. A path
    # that cannot even be looked at (too long, a NUL byte) is `writable_target`'s to explain.
    existing = [Path(p) for p in paths if p is not None and _exists(Path(p).expanduser())
                and not Path(p).expanduser().is_dir()]
    if existing and not force:
        raise UserError([Problem(str(p), "exists and would be overwritten",
                                 fix="pass --force to overwrite it, or write to another path") for p in existing])


def output_file(value: Union[str, Path], option: str, force: bool, *, suffix: str = "") -> Path:
    """A file a command is asked to write (`-o`, `--plot`): `~` expanded and, with `suffix`,
    the suffix the writer would add itself (matplotlib writes `plot` as `plot.png`), so the
    file checked is the file written; refused if it exists without --force, or if its folder
    cannot be written. The caller writes to the path returned."""
    path = Path(value).expanduser()
    if suffix and not path.suffix and not (_exists(path) and path.is_dir()):  # a directory is refused below
        path = path.with_name(path.name + suffix)
    keep_existing_files((path,), force)
    return writable_target(path, option)


def write_text(path: Union[str, Path], text: str, key: str, what: str = "") -> None:
    """A small file (resolved.json, a script, a config) written whole, or a clear message and
    the previous file as it was: written beside its name, then renamed over it (through a
    symbolic link, to the file it points at)."""
    from overdrive.storage.whole_file import replace_whole

    path = Path(path)
    with writing(path, key, what=what or path.name):
        replace_whole(path, text)


# ---------------------------------------------------------------- where a command writes

_PLACES: list[tuple[Path, str]] = []  # (directory, key): what the running command writes into


@contextmanager
def places(**keys: Union[str, Path, None]) -> Iterator[None]:
    """Declare the directories a command writes into, by key (`places(output_dir=..., **{"data.cache_dir": ...})`),
    so a fault reaching the command boundary without a path of its own (a tracker's thread)
    still names the right one."""
    added = [(Path(v).expanduser().absolute(), k) for k, v in keys.items() if v]
    _PLACES[:0] = added
    try:
        yield
    finally:
        for item in added:
            _PLACES.remove(item)


def _place_of(filename: Optional[str]) -> tuple[Optional[Path], str]:
    if filename:
        target = Path(filename).expanduser().absolute()
        for folder, key in sorted(_PLACES, key=lambda p: len(p[0].parts), reverse=True):
            if target == folder or folder in target.parents:
                return target, key
        return target, ""
    return (_PLACES[0][0], _PLACES[0][1]) if _PLACES else (None, "")


def as_user_error(error: BaseException) -> Optional[UserError]:
    """At the command boundary: a write fault nobody mapped on the way, as the one message."""
    filename = next((str(e.filename) for e in _chain(error) if isinstance(e, OSError) and e.filename), None)
    path, key = _place_of(filename)
    number = fault_errno(error, path)
    if number is None:
        return None
    return explain(error, path, key, number=number)


@contextmanager
def thread_faults() -> Iterator[list]:
    """A write fault in a library's own thread (TensorBoard's event writer) is kept here instead
    of printed as a raw traceback; the command raises it when it returns, and the library's
    next call from the main thread usually raises it sooner. Other thread errors print as before."""
    import threading

    held: list = []
    previous = threading.excepthook

    def hook(args) -> None:
        if args.exc_value is not None and fault_errno(args.exc_value) is not None:
            held.append(args.exc_value)
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield held
    finally:
        threading.excepthook = previous
