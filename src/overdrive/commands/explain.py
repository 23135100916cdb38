"""`overdrive explain`: every effective value and the layer that set it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from overdrive.errors import Problem, UserError


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The config inputs every command that resolves a config takes."""
    parser.add_argument("items", nargs="*", metavar="FILE|KEY=VALUE",
                        help="config files (overdrive, Accelerate or DeepSpeed), then key=value overrides")
    parser.add_argument("--no-accelerate-default", action="store_true",
                        help="ignore Accelerate's default_config.yaml")


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    """Files and key=value items, as typed in any order."""
    files = [item for item in items if "=" not in item]
    cli = [item for item in items if "=" in item]
    return files, cli


def resolve_from_args(args: argparse.Namespace):
    from overdrive.config import resolve

    files, cli = split_items(args.items)
    return resolve(files, cli=cli, accelerate_default=not args.no_accelerate_default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--key", help="show the whole chain for one dotted key (each layer's value, and which won)")
    parser.add_argument("--json", action="store_true", help='print {"config": ..., "origins": {dotted key: origin}}')
    parser.add_argument("--all", action="store_true", help="also list every default value")


def _shown(key: str, value: Any) -> str:
    from overdrive.config.redact import shown

    value = shown(key, value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return "null" if value is None else str(value)


def _flat_values(config) -> dict[str, Any]:
    """Every leaf as a dotted key, open mappings (`model.architecture.n_layer`) included."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for name, child in node.items():
                walk(child, f"{prefix}.{name}" if prefix else str(name))
        else:
            flat[prefix] = node

    walk(config.model_dump(mode="json"), "")
    return flat


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
    chain = resolved.chains.get(key)
    if not chain:
        if not is_known(key):
            raise UserError(Problem(key, "unknown key" + suggest(key)))
        print(f"{key} = {_shown(key, _flat_values(resolved.config).get(key))}  (default)")
        return 0
    from overdrive.config.redact import redact_text

    print(f"{key} = {_shown(key, chain[-1].value)}")
    for index, setting in enumerate(chain):
        mark = "wins" if index == len(chain) - 1 else "overridden"
        print(f"  {index + 1}. {setting.origin.layer:<18} {_shown(key, setting.value):<20} "
              f"{redact_text(str(setting.origin.source))}{':' + str(setting.origin.line) if setting.origin.line else ''}  [{mark}]")
    return 0


def run(args: argparse.Namespace) -> int:
    from overdrive.config import hardware_warnings

    resolved = resolve_from_args(args)
    warnings = resolved.warnings + hardware_warnings(resolved)
    if args.key:
        return _explain_key(resolved, args.key)
    from overdrive.config.redact import redact, redact_text

    if args.json:
        print(json.dumps({
            "config": redact(resolved.config.model_dump(mode="json")),
            "origins": {key: redact_text(str(origin)) for key, origin in sorted(resolved.origins.items())},
            "warnings": [redact_text(problem.render()) for problem in warnings],
        }, indent=2))
        return 0
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
    _print_problems("warnings", warnings)
    return 0
