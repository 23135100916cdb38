"""Resolve a run config from its six layers, with the provenance of every value.

    resolved = resolve(["run.yaml"], cli=["lr=3e-4"])   # Resolved: config + origins + chains
    cfg = load_config("run.yaml", overrides={"precision.mixed_precision": "bf16"})  # RunConfig
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import ValidationError

from overdrive.config import batch, layers, validate
from overdrive.config.layers import Origin, Setting
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

__all__ = ["SECRETS_VARIABLE", "Origin", "Resolved", "RunConfig", "check_for_train", "load_config", "resolve", "accelerate_default_path"]


@dataclass
class Resolved:
    """A validated run config and, per dotted key, where its value came from."""

    config: RunConfig
    origins: dict[str, Origin]
    chains: dict[str, list[Setting]] = field(default_factory=dict)
    warnings: list[Problem] = field(default_factory=list)
    # The resume judged once, by whoever starts the run (training/settle.py): the checkpoint
    # it resumes ({"checkpoint": path or None, "force": bool, "notes": [...]}), handed to
    # the workers in the resolved file so they do not judge it again.
    resume: dict[str, Any] | None = None

    def to_json(self) -> str:
        """The hand-off to workers and the record in output_dir: values and their origins,
        secrets masked (a worker gets them from SECRETS_VARIABLE, see `secret_values`)."""
        from overdrive.config.redact import redact, redact_text

        data: dict[str, Any] = {
            "config": redact(self.config.model_dump(mode="json")),
            "origins": {key: redact_text(str(origin)) for key, origin in sorted(self.origins.items())},
            "origin_records": {key: [o.layer, redact_text(str(o.source)), o.line] for key, o in sorted(self.origins.items())},
        }
        if self.resume is not None:
            data["resume"] = self.resume
        return json.dumps(data, indent=2)

    def secret_values(self) -> dict[str, Any]:
        """{dotted key: value} of what `to_json` masks: handed to workers in their environment."""
        from overdrive.config.redact import redact

        plain = _flatten(self.config.model_dump(mode="json"))
        masked = _flatten(redact(self.config.model_dump(mode="json")))
        return {key: value for key, value in plain.items() if masked.get(key) != value}

    @classmethod
    def from_json(cls, text: str, where: str = "resolved config", environ: Mapping[str, str] | None = None) -> "Resolved":
        """Read what `to_json` wrote; masked secrets come back from SECRETS_VARIABLE."""
        from overdrive.config.sources import parse_text

        data, _ = parse_text(text, where, json_first=True)
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
            raise UserError(Problem("", "not a resolved config (no \"config\" mapping)", where,
                                    "pass the resolved.json written by overdrive for this run"))
        config = data["config"]
        environ = os.environ if environ is None else environ
        try:
            secrets = json.loads(environ.get(SECRETS_VARIABLE) or "{}")
        except ValueError:
            secrets = {}
        for key, value in (secrets if isinstance(secrets, dict) else {}).items():
            _set_dotted(config, key, value)
        try:
            config = RunConfig.model_validate(config)
        except ValidationError as error:
            raise UserError(_pydantic_problems(error, {}), title=f"{where} is not a valid run config") from None
        records = data.get("origin_records") or {}
        try:
            origins = {key: Origin(*record) for key, record in records.items()}
        except TypeError:
            origins = {}
        return cls(config=config, origins=origins, resume=data.get("resume"))


SECRETS_VARIABLE = "OVERDRIVE_SECRET_VALUES"


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        flat: dict[str, Any] = {}
        for name, child in node.items():
            flat.update(_flatten(child, f"{prefix}.{name}" if prefix else str(name)))
        return flat
    return {prefix: node}


def _set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    node = config
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return
    node[parts[-1]] = value


def accelerate_default_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where `accelerate config` writes its default: $HF_HOME/accelerate/default_config.yaml."""
    environ = os.environ if environ is None else environ
    hf_home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(hf_home) / "accelerate" / "default_config.yaml"


def _pydantic_problems(error: ValidationError, chains: Mapping[str, list[Setting]]) -> list[Problem]:
    from overdrive.config.redact import shown

    # One bad value in a Union field yields one error per member: report it once, saying
    # what each member would have accepted.
    messages: dict[str, list[str]] = {}
    for item in error.errors():
        loc = [str(part) for part in item["loc"] if not str(part).startswith(("function-", "literal["))]
        # Union members add their type name to loc ("int", "literal['auto']"): keep the key only.
        while loc and ".".join(loc) not in chains and ".".join(loc[:-1]) in chains:
            loc = loc[:-1]
        key = ".".join(loc)
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            from overdrive.config.keys import suggest

            message = "unknown key" + suggest(key)
        messages.setdefault(key, []).append(message if not messages.get(key) else message.lower())
    problems = []
    for key, texts in messages.items():
        chain = chains.get(key)
        where = str(chain[-1].origin) if chain else ""
        got = f" (got {shown(key, chain[-1].value)!r})" if chain else ""
        problems.append(Problem(key, "; or ".join(dict.fromkeys(texts)) + got, where))
    return problems


def resolve(
    files: Sequence[str | Path] = (),
    cli: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    accelerate_default: bool | str | Path = True,
    above: Sequence[str | Path] = (),
) -> Resolved:
    """Resolve every layer, validate, and return the config with provenance.

    `above`: files applied over every layer, overrides included (a sweep trial's values:
    `overdrive sweep` writes them, labelled with their own `layer:`).

    Raises UserError listing every problem found (unknown keys, types, ranges, cross-field
    and world-size rules). Hardware checks are separate: see `check_for_train`.
    """
    environ = os.environ if env is None else env
    if accelerate_default is True:
        default_path: Path | None = accelerate_default_path(environ)
    elif accelerate_default:
        default_path = Path(accelerate_default)
    else:
        default_path = None
    outputs = [layers.defaults_layer(), layers.accelerate_default_layer(default_path)]
    outputs += [layers.file_layer(path) for path in files]
    outputs += [layers.env_layer(environ), layers.cli_layer(cli), layers.overrides_layer(overrides)]
    outputs += [layers.file_layer(path) for path in above]

    errors = [problem for output in outputs for problem in output.errors]
    warnings = [problem for output in outputs for problem in output.warnings]
    chains = layers.merge(outputs)
    try:
        config = RunConfig.model_validate(layers.nest(chains))
    except ValidationError as error:
        type_errors = _pydantic_problems(error, chains)
        # Still run the cross-field rules, on the config minus the bad values, so one run
        # reports every problem rather than making the user fix them one by one.
        bad = {problem.key for problem in type_errors}
        usable = {key: chain for key, chain in chains.items() if key not in bad}
        try:
            partial = RunConfig.model_validate(layers.nest(usable))
            errors += validate.check(partial, usable)[0]
        except ValidationError:
            pass
        raise UserError(errors + type_errors) from None
    config, derived = batch.settle(config, chains)  # the batch split, settled once here
    rule_errors, rule_warnings = validate.check(config, chains)
    errors += rule_errors
    if errors:
        raise UserError(errors)
    origins = {key: chain[-1].origin for key, chain in chains.items()}
    if derived is not None:
        origins[batch.ACCUMULATION] = derived
    return Resolved(config=config, origins=origins, chains=chains, warnings=warnings + rule_warnings)


def load_config(*files: str | Path, overrides: Mapping[str, Any] | None = None, cli: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> RunConfig:
    """The resolved RunConfig for these files, command-line items and overrides."""
    return resolve(files, cli=cli, overrides=overrides, env=env).config


def hardware_warnings(resolved: Resolved, hardware=None) -> list[Problem]:
    from overdrive.system import hardware as hw
    return validate.hardware_problems(resolved.config, resolved.chains, hardware or hw.detect(light=True))


def check_for_train(resolved: Resolved, hardware=None) -> None:
    """Before training: what this machine lacks of what the config asks is an error."""
    from overdrive.system import hardware as hw
    problems = validate.hardware_problems(resolved.config, resolved.chains, hardware or hw.detect(light=False))
    if problems:
        raise UserError(problems, title="this machine cannot run the config as written")
