"""`overdrive export CONFIG --accelerate acc.yaml --deepspeed ds.json`

Writes the Accelerate YAML and DeepSpeed JSON that `accelerate launch` accepts for the same
run; `overdrive import` reads them back.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.explain import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--accelerate", metavar="FILE", help="write an Accelerate config (YAML) here")
    parser.add_argument("--deepspeed", metavar="FILE", help="write the DeepSpeed config (JSON) here")
    parser.add_argument("--batch-auto", action="store_true",
                        help='leave the DeepSpeed batch sizes "auto" (the script\'s DataLoader decides them)')
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")


def run(args: argparse.Namespace) -> int:
    from overdrive.interop import writing as export
    from overdrive.commands.explain import resolve_from_args
    from overdrive.errors import UserError, keep_existing_files

    if not args.accelerate and not args.deepspeed:
        raise UserError("nothing to write: give --accelerate FILE and/or --deepspeed FILE")
    keep_existing_files((args.accelerate, args.deepspeed), args.force)
    cfg = resolve_from_args(args).config
    for path in export.write(cfg, args.accelerate, args.deepspeed, batch_auto=args.batch_auto):
        print(f"wrote {path}")
    return 0
