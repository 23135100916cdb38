"""A local data file's rows read whole, light (no datasets, no torch, nothing written): what
`explain` and `train` check every row of before a model loads (data/prompt_checks.py).

jsonl, json (a list of rows), csv and parquet files; a `save_to_disk` directory or a hub data set
is not read here (its rows are checked where the run reads them, still before the model loads).
Each row keeps where it sits in its file: a jsonl row its line, other rows their number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from overdrive.errors import Problem, UserError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


@dataclass
class RowTable:
    rows: list[dict]
    name: str  # the file (or the data set) as the user named it
    lines: Optional[list[int]] = None  # a jsonl row's line in its file; None: the row's number is its place
    columns: list[str] = field(default_factory=list)  # every column any row has, in first-seen order

    def __post_init__(self) -> None:
        if not self.columns:
            self.columns = list(dict.fromkeys(name for row in self.rows for name in row))

    def place(self, index: int) -> str:
        """`file:line` for a jsonl row, `file row N` otherwise (index 0-based)."""
        if self.lines is not None:
            return f"{self.name}:{self.lines[index]}"
        return f"{self.name} row {index + 1}"


def local_table(source: Optional[str]) -> Optional[RowTable]:
    """The rows of a local data file, or None where the source is not one (a hub name, a directory, no file
    here: `explain` takes a config meant for another machine)."""
    if not source:
        return None
    path = Path(source).expanduser()
    if not path.is_file() or path.suffix.lower() not in SUFFIXES:
        return None
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # datasets' own reader of the format: installed with it

        return RowTable(pq.read_table(path).to_pylist(), source)
    text = _text(path, source)
    if suffix == ".csv":
        import csv
        import io

        return RowTable([dict(row) for row in csv.DictReader(io.StringIO(text, newline=""))], source)
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as error:
            raise UserError(Problem("data.source", f"not JSON: {error}", f"{source}:{error.lineno}",
                                    "give a list of objects, or one object a line (jsonl)")) from None
        return RowTable([row if isinstance(row, dict) else {"": row} for row in rows], source)
    return _json_lines(text, source)


def _text(path: Path, source: str) -> str:
    """The file as text (a BOM is not data, as datasets reads it); bytes that are not UTF-8 refused by
    their line, as the run would fail on them mid-read."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(_undecodable(source, data, error.start)) from None


def _undecodable(name: str, head: bytes, at: int, line: int = 1) -> Problem:
    line += head[:at].count(b"\n")
    return Problem("data.source", f"{name} is not UTF-8 text: byte 0x{head[at]:02x} on line {line} (another "
                   "encoding, such as Latin-1 or UTF-16)", f"{name}:{line}",
                   f"save the file as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 {name} > new-file)")


def undecodable(path: Path, name: str, piece_bytes: int = 1 << 24) -> Optional[Problem]:
    """The first byte of `path` that is not UTF-8, as a problem naming its line; None when all of it
    decodes. Read in pieces: a file met mid-run may be large."""
    import codecs

    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with path.open("rb") as f:
        while piece := f.read(piece_bytes):
            pending = decoder.getstate()[0]  # a character cut at the end of the piece before
            try:
                decoder.decode(piece)
            except UnicodeDecodeError as error:
                return _undecodable(name, pending + piece, max(error.start, 0), line - pending.count(b"\n"))
            line += piece.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:  # the file ends inside a character
        return _undecodable(name, error.object, max(error.start, 0), line)
    return None


def _json_lines(text: str, source: str) -> RowTable:
    rows, lines, bad = [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            bad.append((number, str(error)))
            continue
        if not isinstance(row, dict):
            bad.append((number, f"a {type(row).__name__}, not an object"))
            continue
        rows.append(row)
        lines.append(number)
    if bad:
        shown = ", ".join(str(n) for n, _ in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise UserError(Problem("data.source", f"{len(bad)} line(s) are not a JSON object (lines {shown}; the first: "
                                f"{bad[0][1]})", f"{source}:{bad[0][0]}", "write one JSON object a line"))
    return RowTable(rows, source, lines)
