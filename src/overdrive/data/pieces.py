"""Plain text read in bounded pieces, and cheap fingerprints of files.

A text file is one document (one end-of-document id after it, as before), read as pieces
of about `PIECE_BYTES`, so a 200 MB file never becomes one 200 MB row. A piece ends where
a line starts with a non-space character: for a byte-level BPE (GPT-2's pre-tokenizer
regex) no pre-token crosses that point, so the ids of the pieces are exactly the ids of the
whole text. Where no such line start exists (one endless line) a piece ends before a
space, and as a last resort at a character boundary.

The start of each piece depends only on where the previous one ended, so reading resumed
from a recorded (file, offset) cuts the same pieces as reading from the beginning.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

PIECE_BYTES = 64 * 1024
_SPACE = b" \t\r\n\x0b\x0c"
_SAMPLES = 8  # chunks hashed per file for its fingerprint
_SAMPLE_BYTES = 4096


def _cut(buf: bytes) -> int:
    """Where a full buffer is cut: the last line start in its second half, else a space, else a char boundary."""
    half = len(buf) // 2
    pos = len(buf)
    while True:
        nl = buf.rfind(b"\n", half, pos)
        if nl < 0 or nl + 1 >= len(buf):
            if nl < 0:
                break
            pos = nl
            continue
        if buf[nl + 1] not in _SPACE:
            return nl + 1
        pos = nl
    pos = len(buf)
    while True:
        sp = buf.rfind(b" ", half, pos)
        if sp <= half:
            break
        if buf[sp - 1] not in _SPACE:
            return sp
        pos = sp
    end = len(buf)
    while end > half and (buf[end - 1] & 0xC0) == 0x80:  # inside a multi-byte UTF-8 character
        end -= 1
    if end > half and buf[end - 1] >= 0xC0:  # a lead byte whose continuation is cut off
        end -= 1
    return end


def read_pieces(path: Path, offset: int = 0, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[str, int, bool]]:
    """(text, offset after it, last piece of the file) from `offset` on."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while offset < size:
            f.seek(offset)
            buf = f.read(piece_bytes)
            if not buf:
                break
            end = len(buf) if offset + len(buf) >= size else _cut(buf)
            offset += end
            yield buf[:end].decode("utf-8", errors="replace"), offset, offset >= size


def iter_file_pieces(paths: Sequence[Path], start: Optional[dict] = None,
                     piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[str, dict, bool, int]]:
    """(text, position after it, end of document, raw bytes) over files in order; each file is a document."""
    file_i, offset = (start or {}).get("file", 0), (start or {}).get("offset", 0)
    for i in range(file_i, len(paths)):
        before = offset if i == file_i else 0
        if os.path.getsize(paths[i]) == 0:
            continue
        for text, after, last in read_pieces(paths[i], before, piece_bytes):
            position = {"file": i + 1, "offset": 0} if last else {"file": i, "offset": after}
            yield text, position, last, after - before
            before = after


def sampled_hash(path: Path) -> str:
    """sha256 of a few evenly spaced chunks (the whole file when small): no full read of a huge file."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(f"{size}".encode())
    with open(path, "rb") as f:
        if size <= _SAMPLES * _SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for k in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * k // (_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def files_fingerprint(paths: Sequence[Path], root: Optional[Path] = None, sample: bool = True) -> str:
    """A key for a list of files: names, sizes, modification times and (with `sample`) sampled content."""
    digest = hashlib.sha256()
    for p in paths:
        st = p.stat()
        name = str(p.relative_to(root)) if root else str(p.resolve())
        digest.update(f"{name}\x00{st.st_size}\x00{st.st_mtime_ns}\x00".encode())
        if sample:
            digest.update(sampled_hash(p).encode())
    return digest.hexdigest()


def estimate_lines(paths: Sequence[Path], sample_bytes: int = 1 << 20) -> Optional[int]:
    """Lines in the files, extrapolated from the first MiB of each (rows of jsonl/csv for progress)."""
    total = 0.0
    for p in paths:
        size = os.path.getsize(p)
        with open(p, "rb") as f:
            head = f.read(sample_bytes)
        if not head:
            continue
        total += head.count(b"\n") * (size / len(head)) if len(head) < size else head.count(b"\n") + (not head.endswith(b"\n"))
    return int(total) or None


def limited(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Yield texts until about `max_bytes` of UTF-8 have gone by (BPE merges saturate early)."""
    seen = 0
    for text in texts:
        if seen >= max_bytes:
            return
        seen += len(text.encode("utf-8", errors="replace"))
        yield text
