"""No command writes over or into its own input.

Every writer asks `refuse_overlap` before it writes anything: an output that is an input,
contains one (a directory written whole replaces what it holds) or lies inside one (a merged
model written into the adapter it was merged from) is refused by the output's key, with or
without --force: --force lets a command replace what the user had, never what it is reading.
Paths are compared after `~`, `..` and symbolic links are resolved, so two spellings of one
place are one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Union

from overdrive.errors import Problem, UserError

PathLike = Union[str, Path]


def _real(path: PathLike) -> Path:
    return Path(path).expanduser().resolve()


def relation(output: PathLike, given: PathLike) -> Optional[str]:
    """How the output stands to the input: "is", "contains", "lies inside", or None (apart)."""
    out, source = _real(output), _real(given)
    if out == source:
        return "is"
    if out in source.parents:
        return "contains"
    if source in out.parents:
        return "lies inside"
    return None


def local_input(value: Optional[str]) -> Optional[Path]:
    """A value naming a place on this machine (a hub name such as `gpt2` is not one): the path,
    or None. Only an existing path is an input a write could destroy."""
    if not value:
        return None
    path = Path(str(value)).expanduser()
    return path if path.exists() else None


def refuse_overlap(outputs: Mapping[str, Optional[PathLike]], inputs: Mapping[str, Optional[PathLike]]) -> None:
    """Every (output, input) pair that overlaps, refused at once by the output's key."""
    problems = []
    for out_key, output in outputs.items():
        if output is None or str(output) == "":
            continue
        for in_key, given in inputs.items():
            if given is None or str(given) == "":
                continue
            how = relation(output, given)
            if how is None:
                continue
            problems.append(Problem(
                out_key, f"{output} {how} {in_key} {given}: writing it would destroy what this command reads "
                "(refused even with --force)", fix="write to a directory or file outside the input"))
    if problems:
        raise UserError(problems)
