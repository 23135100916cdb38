"""The resolved run: a validated RunConfig with the origin of every value, and its JSON form,
the hand-off to workers and the record in output_dir (resolved.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from overdrive.config.env_report import process_environment
from overdrive.config.keys import flatten, set_dotted
from overdrive.config.redact import masked_item
from overdrive.config.provenance import Origin, Setting
from overdrive.config.schema import RunConfig
from overdrive.config.stored import CONFIG_VERSION, read_stored
from overdrive.errors import Problem, UserError

@dataclass
class Resolved:
    """A validated run config and, per dotted key, where its value came from."""

    config: RunConfig
    origins: dict[str, Origin]
    chains: dict[str, list[Setting]] = field(default_factory=dict)
    warnings: list[Problem] = field(default_factory=list)
    # The resume judged once, by whoever starts the run (training/build/settle.py): the checkpoint
    # it resumes ({"checkpoint": path or None, "force": bool, "notes": [...]}), handed to
    # the workers in the resolved file so they do not judge it again.
    resume: dict[str, Any] | None = None
    # The FILE and KEY=VALUE items the user typed, in order, and --no-accelerate-default when
    # given (None: a config built in Python):
    # what a hint after the run repeats so it keeps the user's config.
    items: list[str] | None = None

    def to_json(self) -> str:
        """The hand-off to workers and the record in output_dir: values and their origins,
        secrets masked (a worker gets them from SECRETS_VARIABLE, see `secret_values`)."""
        from overdrive.config.redact import redact, redact_text

        data: dict[str, Any] = {
            "config_version": CONFIG_VERSION,
            "config": redact(self.config.model_dump(mode="json")),
            "origins": {key: redact_text(str(origin)) for key, origin in sorted(self.origins.items())},
            "origin_records": {key: [o.layer, redact_text(str(o.source)), o.line] for key, o in sorted(self.origins.items())},
        }
        if self.resume is not None:
            data["resume"] = self.resume
        if self.items is not None:
            data["items"] = [masked_item(item) for item in self.items]
        return json.dumps(data, indent=2)

    def secret_values(self) -> dict[str, Any]:
        """{dotted key: value} of what `to_json` masks: handed to workers in their environment."""
        from overdrive.config.redact import redact

        plain = flatten(self.config.model_dump(mode="json"))
        masked = flatten(redact(self.config.model_dump(mode="json")))
        return {key: value for key, value in plain.items() if masked.get(key) != value}

    @classmethod
    def from_json(cls, text: str, where: str = "resolved config", environ: Mapping[str, str] | None = None) -> "Resolved":
        """Read what `to_json` wrote; masked secrets come back from SECRETS_VARIABLE."""
        from overdrive.config.sources import parse_text

        data, _ = parse_text(text, where, json_first=True)
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
            raise UserError(Problem("", "not a resolved config (no \"config\" mapping)", where,
                                    "pass the resolved.json written by overdrive for this run"))
        stored = dict(data["config"])
        environ = process_environment(environ)
        try:
            secrets = json.loads(environ.get(SECRETS_VARIABLE) or "{}")
        except ValueError:
            secrets = {}
        for key, value in (secrets if isinstance(secrets, dict) else {}).items():
            set_dotted(stored, key, value)
        config = read_stored({**data, "config": stored}, where)
        records = data.get("origin_records") or {}
        try:
            origins = {key: Origin(*record) for key, record in records.items()}
        except TypeError:
            origins = {}
        items = data.get("items")
        items = [str(item) for item in items] if isinstance(items, list) else None
        return cls(config=config, origins=origins, resume=data.get("resume"), items=items)




SECRETS_VARIABLE = "OVERDRIVE_SECRET_VALUES"


def config_directories(origins: Iterable[Origin]) -> list[Path]:
    """Where the user's own modules (reward functions) are looked for: the directory of every config file that
    set a value, then the working directory, as `python run.py` finds a module beside the script."""
    found = [Path(o.source).expanduser().resolve().parent for o in origins if o.layer == "file" and o.source]
    return list(dict.fromkeys([*found, Path.cwd()]))
