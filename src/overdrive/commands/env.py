"""`overdrive env`: versions, hardware, Accelerate default config and run variables.

Markdown by default, ready to paste into a bug report; `--json` for tools.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument(
        "--no-hardware", action="store_true", help="skip the hardware probe (does not import torch; faster)"
    )


def run(args: argparse.Namespace) -> int:
    from overdrive.config.redact import redact, redact_text
    from overdrive.resolving.layer_changes import layer_changes
    from overdrive.system.report import collect, to_markdown

    report = redact(collect(layer_changes(), with_hardware=not args.no_hardware))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(redact_text(to_markdown(report)), end="")
    return 0
