"""A run config stored by an earlier run, read back into a RunConfig: the one reader of
resolved.json's and a checkpoint's `config`.

A stored config carries `config_version` beside it (resolved.json and trainer_state.json write
it at the top level); a config written before that field existed is version 0. Reading migrates
it to the current schema:

- a key the config was written without (it did not exist yet: the pipeline axis, the expert
  axis, rl.*, ...) gets the schema's default, which is what that run used;
- a key renamed since is moved to its new name, and a key removed since is dropped, each with
  the reason (`RENAMED`, `DROPPED` below). No key of the schema has been renamed or removed so
  far: the leaf keys of every version of config/schema*.py in the project's history are a subset
  of today's, and so are the names each `Literal` setting accepts.

What cannot be read (not a mapping, a version newer than this overdrive's, a value the schema
refuses) is a UserError naming the file: exit code 2, never a traceback.

    cfg = read_stored(json.loads(path.read_text()), str(path))
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from overdrive.config.keys import flatten, suggest, unflatten
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

# The version written today. 1: the first versioned config (the schema as of this change).
CONFIG_VERSION = 1

# {version that renamed it: {old dotted key: (new dotted key, why)}}: applied to configs older than the version.
RENAMED: dict[int, dict[str, tuple[str, str]]] = {}
# {version that removed it: {old dotted key: why}}: dropped from configs older than the version.
DROPPED: dict[int, dict[str, str]] = {}


def stamped(record: dict[str, Any]) -> dict[str, Any]:
    """`record` (holding a stored `config`) with the config's version beside it."""
    return {"config_version": CONFIG_VERSION, **record}


def version_of(data: Mapping[str, Any], source: str) -> int:
    version = data.get("config_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise UserError(Problem("config_version", f"{version!r} is not a config version", source,
                                fix="pass a file written by overdrive (its config_version is a whole number)"))
    if version > CONFIG_VERSION:
        raise UserError(Problem("config_version", f"{version} is newer than this overdrive reads "
                                f"(up to {CONFIG_VERSION})", source,
                                fix="read it with the overdrive version that wrote it, or upgrade overdrive"))
    return version


def migrate(config: Mapping[str, Any], version: int) -> tuple[dict[str, Any], list[str]]:
    """A config of `version` in today's keys, and a note per key renamed or dropped on the way.
    Keys it lacks are left out: validation gives them their defaults."""
    flat, notes = flatten(config), []
    for since in sorted(set(RENAMED) | set(DROPPED)):
        if version >= since:
            continue
        for old, (new, why) in RENAMED.get(since, {}).items():
            moved = {k: v for k, v in flat.items() if k == old or k.startswith(old + ".")}
            for key, value in moved.items():
                del flat[key]
                flat.setdefault(new + key[len(old):], value)
            if moved:
                notes.append(f"{old} -> {new}: {why}")
        for old, why in DROPPED.get(since, {}).items():
            gone = [k for k in flat if k == old or k.startswith(old + ".")]
            for key in gone:
                del flat[key]
            if gone:
                notes.append(f"{old} dropped: {why}")
    return unflatten(flat), notes


def read_stored(data: Any, source: str) -> RunConfig:
    """The RunConfig of a stored record: `data` is the record holding `config` (and
    `config_version`; none: version 0), as resolved.json and trainer_state.json hold it."""
    if not isinstance(data, Mapping) or not isinstance(data.get("config"), Mapping):
        raise UserError(Problem("config", "holds no stored run config (a `config` mapping)", source,
                                fix="pass a resolved.json or checkpoint written by overdrive"))
    config, _ = migrate(data["config"], version_of(data, source))
    try:
        return RunConfig.model_validate(config)
    except ValidationError as error:
        raise UserError(_problems(error, source), title=f"{source}: the stored run config cannot be read") from None


def _problems(error: ValidationError, source: str) -> list[Problem]:
    found: dict[str, str] = {}
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"] if not str(p).startswith(("function-", "literal[")))
        message = ("unknown key" + suggest(key)) if item["type"] == "extra_forbidden" else item["msg"]
        found.setdefault(key, message)
    return [Problem(key, message, source, fix="the stored config does not fit this overdrive's schema: read it with "
                    "the overdrive version that wrote it, or start the run over") for key, message in found.items()]
