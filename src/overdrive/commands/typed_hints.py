"""What people type that overdrive does not take, answered with what it does take.

    overdrive trian                    -> did you mean `overdrive train`?
    overdrive train --max_steps 20     -> write it as training.max_steps=20
    overdrive train --resume           -> resuming is automatic: run the same command again

Config keys are KEY=VALUE items, never `--flags`: a flag named like a key (in any section,
with - or _) is turned into the item it meant.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Optional, Sequence

from overdrive.errors import Problem, UserError

RESUME = ("resuming is automatic: run the same command again and it continues from the newest complete "
          "checkpoint in output_dir (checkpoint.resume=auto); checkpoint.resume=never starts afresh, "
          "and --force resumes even when the config changed keys that alter the math")
FORCE = ("--force is train's: it resumes from the checkpoint in output_dir even though the config changed "
         "keys that alter the math")


def unknown_command(name: str, commands: Sequence[str]) -> UserError:
    """`overdrive trian`: the close command names; a config file given as a command: train it."""
    close = difflib.get_close_matches(name, list(commands), n=3, cutoff=0.6)
    if name.endswith((".yaml", ".yml", ".json", ".toml")) or "=" in name:
        fix = f"train it: overdrive train {name}"
    elif close:
        fix = " or ".join(f"`overdrive {c}`" for c in close) + "?"
    else:
        fix = "overdrive --help lists the commands; overdrive help COMMAND shows one"
    return UserError(Problem("", f"unknown command {name!r}", fix=("did you mean " if close else "") + fix))


def key_for_flag(flag: str) -> Optional[str]:
    """The config key a `--flag` names: `--max_steps`, `--max-steps`, `--training.max_steps`, `--lr`."""
    from overdrive.config.keys import ALIASES, expand_alias, is_known, leaf_annotations

    name = flag.lstrip("-").replace("-", "_")
    if is_known(expand_alias(name)):
        return expand_alias(name)
    by_last = [key for key in leaf_annotations() if key.rpartition(".")[2] == name]
    if len(by_last) == 1:
        return by_last[0]
    return expand_alias(name) if name in ALIASES else None


def flag_hint(argv: Sequence[str], parser: argparse.ArgumentParser) -> Optional[UserError]:
    """A hint for the first `--flag` this command does not take, when it names a key or a habit."""
    known = set(parser._option_string_actions)  # argparse's own table of the command's options
    for index, token in enumerate(argv):
        if not token.startswith("--") or token == "--":
            continue
        flag, eq, inline = token.partition("=")
        if flag in known:
            continue
        if flag in ("--resume", "--resume-from", "--resume_from_checkpoint", "--continue"):
            return UserError(Problem(flag, "is not an option", fix=RESUME))
        if flag == "--force":
            return UserError(Problem(flag, "is not an option of this command", fix=FORCE))
        key = key_for_flag(flag)
        if key is None:
            continue
        following = argv[index + 1] if index + 1 < len(argv) else ""
        value = inline if eq else (following if following and not following.startswith("-") and "=" not in following
                                   else "VALUE")
        return UserError(Problem(flag, "config keys are KEY=VALUE items, not options",
                                 fix=f"write it as {key}={value}"))
    return None


class HintingParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals of a config key as a flag say how to write it."""

    argv: Sequence[str] = ()

    def error(self, message: str):  # argparse's hook for every refusal
        hint = flag_hint(self.argv, self)
        if hint is not None:
            raise hint
        super().error(message)
