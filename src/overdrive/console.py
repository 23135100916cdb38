"""Terminal output shared by the commands: rich on a terminal, plain text everywhere else.

Output that goes to a pipe, a file or a CI log must stay greppable and diffable, so tables
fall back to aligned plain text and nothing is coloured. In a multi-process run only the
main process prints; the others get a console that swallows everything.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, Sequence, TextIO


def is_main_process() -> bool:
    """True unless this is a non-zero rank of an initialised process group.

    torch.distributed is consulted only if something already imported it: importing torch
    just to learn the rank would cost a second on every `overdrive --help`.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # a half-torn-down process group: printing is the safer choice
        return True
    return True


def is_interactive(stream: Optional[TextIO] = None) -> bool:
    """True when `stream` (default: stdout) is a terminal a person is looking at."""
    stream = stream if stream is not None else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def get_console(stderr: bool = False, quiet: bool = False, file: Optional[TextIO] = None):
    """A rich Console for this process: silent on non-main ranks or when `quiet`.

    rich already drops colour and cursor tricks when the stream is not a terminal; the width
    is pinned there so that wrapped lines do not depend on the environment of the CI box.
    """
    from rich.console import Console

    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    interactive = is_interactive(stream)
    return Console(
        file=stream,
        quiet=quiet or not is_main_process(),
        highlight=False,
        soft_wrap=not interactive,
        width=None if interactive else 120,
    )


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_plain_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart; no borders to strip in a script."""
    text_rows = [[_cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row[: len(widths)]):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in text_rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def print_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    title: Optional[str] = None,
    console=None,
    file: Optional[TextIO] = None,
) -> None:
    """A rich table on a terminal, aligned plain text otherwise. Prints nothing off rank 0."""
    if not is_main_process():
        return
    rows = list(rows)
    stream = file if file is not None else (console.file if console is not None else sys.stdout)
    if console is None and is_interactive(stream):
        console = get_console(file=stream)
    if console is not None and is_interactive(console.file):
        from rich.table import Table

        table = Table(title=title, title_justify="left", header_style="bold")
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*(_cell(c) for c in row))
        console.print(table)
        return
    if console is not None and console.quiet:
        return
    text = format_plain_table(headers, rows)
    print(f"{title}\n{text}" if title else text, file=stream)


def counted(count: int, noun: str, plural: str = "") -> str:
    """"1 device", "2 devices", "1 process": the count with its noun in the right number."""
    return f"{count} {noun if count == 1 else (plural or noun + ('es' if noun.endswith('s') else 's'))}"
