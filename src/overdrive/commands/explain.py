"""`overdrive explain`: every effective value and the layer that set it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Mapping

from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.arguments import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--key", help="show the whole chain for one dotted key (each layer's value, and which won)")
    parser.add_argument("--json", action="store_true", help='print {"config": ..., "origins": {dotted key: origin}}')
    parser.add_argument("--all", action="store_true", help="also list every default value")
    parser.add_argument("--training-arguments", action="store_true",
                        help="the Transformers TrainingArguments overdrive.hf.training_arguments(cfg) builds: "
                             "each field, its value and the overdrive key it comes from (with --json: as JSON)")


def _shown(key: str, value: Any) -> str:
    from overdrive.config.redact import shown

    value = shown(key, value)
    if isinstance(value, list):  # data.sources: the keys each entry sets, not every empty one
        value = [{k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item for item in value]
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return "null" if value is None else str(value)


def _flat_values(config) -> dict[str, Any]:
    """Every leaf as a dotted key, open mappings (`model.architecture.n_layer`) included."""
    from overdrive.config.keys import flatten

    return flatten(config.model_dump(mode="json"))


def _origin_of(origins: dict, key: str):
    """The origin of a key, of the open-mapping entry holding it, or of a key under it."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:end]))
        if origin is not None:
            return origin
    return next((o for k, o in origins.items() if k.startswith(key + ".")), None)


def _is_schema_default(origin) -> bool:
    return origin is None or (origin.layer == "default" and not origin.source)


def _print_problems(title: str, problems: list[Problem]) -> None:
    from overdrive.config.redact import redact_text

    if problems:
        print(f"{title}:", file=sys.stderr)
        for problem in problems:
            print(f"  - {redact_text(problem.render())}", file=sys.stderr)


def _explain_key(resolved, key: str) -> int:
    from overdrive.config.keys import expand_alias, is_known, suggest

    key = expand_alias(key)
    chain = list(resolved.chains.get(key) or [])
    # A value settled after the layers merged (the accumulation a global batch derives, a
    # resume's): the value the run uses, its origin last, winning.
    value, origin = _flat_values(resolved.config).get(key), resolved.origins.get(key)
    settled = origin is not None and origin.layer in ("derived", "resume") and \
        not (chain and chain[-1].origin == origin)
    if not chain and not settled:
        if not is_known(key):
            raise UserError(Problem(key, "unknown key" + suggest(key)))
        print(f"{key} = {_shown(key, value)}  (default)")
        return 0
    from overdrive.config.redact import redact_text

    rows = [(s.origin, s.value) for s in chain] + ([(origin, value)] if settled else [])
    print(f"{key} = {_shown(key, rows[-1][1])}")
    for index, (where, shown) in enumerate(rows):
        mark = "wins" if index == len(rows) - 1 else "overridden"
        print(f"  {index + 1}. {where.layer:<18} {_shown(key, shown):<20} "
              f"{redact_text(str(where.source))}{':' + str(where.line) if where.line else ''}  [{mark}]")
    return 0


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 1] + "… (--json: all)"


def _explain_training_arguments(resolved, as_json: bool) -> int:
    from overdrive.hf.fields import FIELDS, UNKNOWN

    rows = []
    for field in FIELDS:
        value = field.value(resolved.config)
        origin = resolved.origins.get(field.key) or next(
            (o for k, o in resolved.origins.items() if k.startswith(field.key + ".")), None)
        shown = "(TrainingArguments default: the config's is auto)" if value is UNKNOWN else value
        rows.append({"field": field.name, "value": shown, "key": field.key, "origin": str(origin or "default"),
                     "under_launch": field.launch})
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from overdrive.console import print_table

    print_table(["TrainingArguments field", "value", "overdrive key", "origin"],
                [(r["field"], _short(_shown(r["field"], r["value"])), r["key"], r["origin"]) for r in rows],
                title="overdrive.hf.training_arguments(cfg)")
    print("Under `overdrive launch`, the fields whose key the config sets (origin other than default) also reach "
          "a script's own TrainingArguments, except use_cpu, deepspeed, fsdp and fsdp_config (given through "
          "Accelerate's environment); see docs/scripts.md.")
    return 0


def run(args: argparse.Namespace) -> int:
    from overdrive.resolving import hardware_warnings

    from overdrive.commands.arguments import resolved_from

    from overdrive.training.build import user_inputs

    # The model's config (no weights), the eval tasks, the user's reward functions and data rows: judged
    # with every other rule, as train judges them, so one pass names every problem.
    resolved = resolved_from(args, tell=False, checks=user_inputs.check, rules=_rules)  # warnings shown below
    machine = hardware_warnings(resolved)
    # A layout axis the machine the run trains on cannot run (context parallel on CPU processes) is
    # refused here as `train` refuses it: the table of what composes answers for layouts. Other
    # hardware gaps stay warnings (a GPU config explained on a laptop); `launch.gpus_per_machine`
    # names other machines, judged by their GPUs.
    layout_refusals = [p for p in machine if p.key in _LAYOUT_AXES]
    warnings = resolved.warnings + [p for p in machine if p not in layout_refusals]
    if args.key:
        return _explain_key(resolved, args.key)
    from overdrive.config.redact import redact, redact_text
    from overdrive.strategies import layout

    if args.training_arguments:
        return _explain_training_arguments(resolved, args.json)
    if args.json:
        print(json.dumps({
            "config": redact(resolved.config.model_dump(mode="json")),
            "origins": {key: redact_text(str(origin)) for key, origin in sorted(resolved.origins.items())},
            "warnings": [redact_text(problem.render()) for problem in warnings],
            "resume": _resume(resolved.config),
            "layout": layout.summary(resolved.config),
            "model": _model(resolved.config),
        }, indent=2))
        return _refuse(layout_refusals)
    rows = []
    for key, value in _flat_values(resolved.config).items():
        origin = _origin_of(resolved.origins, key)
        default = _is_schema_default(origin)
        if default and not args.all:
            continue
        rows.append((default, key, _shown(key, value), redact_text(str(origin or "default"))))
    rows.sort(key=lambda row: row[0])  # non-default values first, schema order within each
    from overdrive.console import print_table

    if rows:
        print_table(["key", "value", "origin"], [row[1:] for row in rows], title="effective configuration")
    else:
        print("every value is the schema default (the embedded job); --all lists them")
    if layout.layout(resolved.config).has_axes:
        print(f"layout: {layout.summary(resolved.config)['text']}")
    model = _model(resolved.config)
    if model["vision"]:
        print(f"model: {model['text']}")
    resume = _resume(resolved.config)
    if resume:
        print(f"resume: {resume['text']}")
    _print_problems("warnings", warnings)
    return _refuse(layout_refusals)


_LAYOUT_AXES = ("parallel.cp_size", "parallel.sp_size")


def _model(config) -> dict:
    """How the model is built (its Auto class; a vision-language model's processor and trained parts)."""
    from overdrive.hf.vision import describe

    return describe(config)


def _refuse(layout_refusals: list[Problem]) -> int:
    """Exit 2 naming each layout axis this run's machines cannot run (after the explanation)."""
    if not layout_refusals:
        return 0
    _print_problems("this machine cannot run the layout (train refuses it too; set launch.gpus_per_machine to "
                    "explain it for GPU machines)", layout_refusals)
    return 2


def _resume(config) -> Any:
    """The checkpoint a train with this config would continue, and how it gets in (None: none)."""
    from overdrive.checkpoint.resume import describe_resume

    return describe_resume(config)


def _rules(config: RunConfig, chains: Mapping[str, list]) -> tuple[list[Problem], list[Problem]]:
    """explain's own rules (resolve.Rules): the model's config as train judges it (a model not readable
    here is a warning), and the eval tasks with their data, as train refuses them before it writes."""
    from overdrive.resolving.validate_model import explained
    from overdrive.training.build.preconditions import check_inputs

    errors, warnings = explained(config, chains)
    try:
        check_inputs(config)
    except UserError as error:
        errors = errors + list(error.problems)
    return errors, warnings
