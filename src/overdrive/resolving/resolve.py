"""Resolve a run config from its six layers, with the provenance of every value.

    resolved = resolve(["run.yaml"], cli=["lr=3e-4"])   # Resolved: config + origins + chains
    cfg = load_config("run.yaml", overrides={"precision.mixed_precision": "bf16"})  # RunConfig
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from pydantic import ValidationError

from overdrive.config import batch, length
from overdrive.config.env_report import process_environment
from overdrive.config.provenance import where
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.resolving import followed_defaults, layers, validate
from overdrive.resolving.problems import pydantic_problems
from overdrive.resolving.resolved import Resolved, config_directories

# A command's checks of what the config points at, from a package above this one (the user's reward
# functions and data: training/build/user_inputs.py): (config, where(key), directories) -> (errors, warnings).
Checks = Callable[[RunConfig, Callable[[str], str], list[Path]], tuple[list[Problem], list[Problem]]]

# A command's own checks of a settled config: (config, chains) -> (errors, warnings).
Rules = Callable[[RunConfig, Mapping[str, list]], tuple[list[Problem], list[Problem]]]


def accelerate_default_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where `accelerate config` writes its default: $HF_HOME/accelerate/default_config.yaml."""
    environ = process_environment(environ)
    hf_home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(hf_home) / "accelerate" / "default_config.yaml"


def resolve(
    files: Sequence[str | Path] = (),
    cli: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    accelerate_default: bool | str | Path = True,
    above: Sequence[str | Path] = (),
    checks: Optional[Checks] = None,
    rules: Optional[Rules] = None,
) -> Resolved:
    """Resolve every layer, validate, and return the config with provenance.

    `above`: files applied over every layer, overrides included (a sweep trial's values:
    `overdrive sweep` writes them, labelled with their own `layer:`).
    `checks`: the command's checks of the user's code and data, reported with the config's problems.

    `rules(config, chains)`: a command's own checks of the settled config, (errors, warnings),
    reported in the same UserError as every rule here (explain and train: the model's config,
    this machine), so one run names every problem.

    Raises UserError listing every problem found (unknown keys, types, ranges, cross-field
    and world-size rules). Hardware checks are separate: see `check_for_train`.
    """
    environ = process_environment(env)
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

    errors = [problem for i, output in enumerate(outputs) for problem in output.errors
              if not _settled_later(problem, outputs[i + 1:])]
    warnings = [problem for output in outputs for problem in output.warnings]
    chains = layers.merge(outputs)
    try:
        config = RunConfig.model_validate(layers.nest(chains))
    except ValidationError as error:
        type_errors = pydantic_problems(error, chains)
        # Still run the cross-field rules, on the config minus the bad values, so one run
        # reports every problem rather than making the user fix them one by one.
        bad = {problem.key for problem in type_errors}
        usable = {key: chain for key, chain in chains.items() if key not in bad}
        try:
            partial = RunConfig.model_validate(layers.nest(usable))
            # a rule about a key whose value was refused judged its default, not the user's value: left out
            errors += [problem for problem in validate.check(partial, usable)[0] if problem.key not in bad]
            errors += [problem for problem in _checked(checks, partial, usable)[0] if problem.key not in bad]
        except ValidationError:
            pass
        raise UserError(errors + type_errors) from None
    config, derived = batch.settle(config, chains)  # the batch split, settled once here
    order = {id(setting): i for i, setting in enumerate(s for output in outputs for s in output.settings)}
    config, length_origins, length_errors, length_warnings = length.settle(config, chains, order)  # steps or epochs
    config, followed = followed_defaults.follow(config, chains)  # defaults the user's choices contradict
    rule_errors, rule_warnings = validate.check(config, chains)
    user_errors, user_warnings = _checked(checks, config, chains)
    rule_warnings += user_warnings
    errors += length_errors + rule_errors + user_errors
    if rules is not None:
        more_errors, more_warnings = rules(config, chains)
        errors += more_errors
        rule_warnings += more_warnings
    warnings += length_warnings
    if errors:
        raise UserError(errors)
    origins = {key: chain[-1].origin for key, chain in chains.items()}
    origins.update(length_origins)
    if derived is not None:
        origins[batch.ACCUMULATION] = derived
    origins.update(followed)
    return Resolved(config=config, origins=origins, chains=chains, warnings=warnings + rule_warnings)


def _checked(checks: Optional[Checks], config: RunConfig, chains) -> tuple[list[Problem], list[Problem]]:
    if checks is None:
        return [], []
    directories = config_directories(chain[-1].origin for chain in chains.values() if chain)
    return checks(config, lambda key: where(chains, key, unset="default"), directories)


def load_config(*files: str | Path, overrides: Mapping[str, Any] | None = None, cli: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> RunConfig:
    """The resolved RunConfig for these files, command-line items and overrides."""
    return resolve(files, cli=cli, overrides=overrides, env=env).config


def hardware_warnings(resolved: Resolved, hardware=None) -> list[Problem]:
    from overdrive.system import hardware as hw
    return validate.hardware_problems(resolved.config, resolved.chains, hardware or hw.detect(light=True))


def _settled_later(problem: Problem, later: Sequence) -> bool:
    """A file's problem that a later layer answers by setting one of its `settled_by` keys."""
    keys = problem.settled_by
    return bool(keys) and any(s.key == k or s.key.startswith(k + ".") for out in later for s in out.settings
                              for k in keys)


def train_hardware_problems(cfg: RunConfig, chains: Mapping[str, list], hardware=None) -> list[Problem]:
    """What this machine lacks of what the config asks, judged as train judges it (errors).

    A run on the CPU (`launch.use_cpu`) asks nothing of the GPUs: they are not looked for, which
    spares a launcher process the import of torch (a second or two before its workers start)."""
    from overdrive.system import hardware as hw
    found = hardware or (hw.detect(light=True, look_for_gpus=False) if cfg.launch.use_cpu else hw.detect(light=False))
    return validate.hardware_problems(cfg, chains, found)


def check_for_train(resolved: Resolved, hardware=None) -> None:
    """Before training: what this machine lacks of what the config asks is an error."""
    problems = train_hardware_problems(resolved.config, resolved.chains, hardware)
    if problems:
        raise UserError(problems, title="this machine cannot run the config as written")
