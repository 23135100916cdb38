"""A command's config, read one way: FILE and KEY=VALUE items as typed (in any order), resolved
with its warnings told once through the redacting printer; or a worker's whole `--resolved`
file, which nothing resolves again."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional

from overdrive.config.redact import redact_text
from overdrive.errors import Problem
from overdrive.resolving.resolve import Checks, Rules, resolve
from overdrive.resolving.resolved import Resolved


def split_items(items: Iterable[str]) -> tuple[list[str], list[str]]:
    """(files, key=value items), each in the order typed."""
    items = list(items)
    return [item for item in items if "=" not in item], [item for item in items if "=" in item]


def tell_warnings(problems: Iterable[Problem]) -> None:
    """Every warning a command tells, on stderr (stdout may be data a user pipes), secrets masked."""
    for problem in problems:
        print(f"overdrive: warning: {redact_text(problem.render())}", file=sys.stderr)


def resolve_items(items: Iterable[str], accelerate_default: bool = True,
                  env: Optional[Mapping[str, str]] = None, tell: bool = True,
                  checks: Optional[Checks] = None, rules: Optional[Rules] = None) -> Resolved:
    """The resolved config of a command's FILE and KEY=VALUE items; its warnings told unless `tell`
    is false (a command that shows them in its own output, as explain does). `checks`: the command's
    checks of the user's code and data; `rules`: its own checks of the settled config (resolve's
    Checks and Rules), reported with the config's problems."""
    refuse_keys_as_files(list(items))
    files, cli = split_items(items)
    resolved = resolve(files, cli=cli, accelerate_default=accelerate_default, env=env, checks=checks, rules=rules)
    if tell:
        tell_warnings(resolved.warnings)
    return resolved


def refuse_keys_as_files(items: list[str]) -> None:
    """`train training.max_steps 20`: a config key typed where a file goes, with its value apart."""
    from overdrive.config.keys import expand_alias, is_known
    from overdrive.errors import UserError

    for index, item in enumerate(items):
        if "=" in item or Path(item).expanduser().exists() or not is_known(expand_alias(item)):
            continue
        following = items[index + 1] if index + 1 < len(items) and "=" not in items[index + 1] else "VALUE"
        raise UserError(Problem(item, "is a config key, not a file: a key and its value are one item, KEY=VALUE",
                                fix=f"write it as {expand_alias(item)}={following}"))


def read_resolved(path: str | Path) -> Resolved:
    """The config a launcher handed its workers (or a trial its process), read whole."""
    from overdrive.config.sources import read_text

    return Resolved.from_json(read_text(path, "resolved config (--resolved)"), where=str(path))
