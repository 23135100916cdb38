"""`overdrive merge ADAPTER -o DIR [--base MODEL]`: a PEFT adapter merged into its base model
(PEFT's merge_and_unload), written with save_pretrained; no run, no config. The base is the
adapter's own (adapter_config.json) unless --base names another. DIR is written whole or not at
all, and an existing DIR is refused without --force; a DIR that is, holds or lies inside the adapter
or a local base is refused always."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("adapter", metavar="ADAPTER", help="a PEFT adapter directory (adapter_config.json + weights)")
    parser.add_argument("-o", "--output", metavar="DIR", required=True, help="where the merged model is written")
    parser.add_argument("--base", metavar="MODEL", help="the base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32",
                        help="dtype the base is loaded and the merged model saved in (default: float32)")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists")


def run(args: argparse.Namespace) -> int:
    from overdrive.errors import Problem, UserError
    from overdrive.hf.merging import merge
    from overdrive.storage import atomic, faults

    from overdrive.hf.saved_model import adapter_base
    from overdrive.storage.overlap import local_input, refuse_overlap

    target, adapter = Path(args.output).expanduser(), Path(args.adapter).expanduser()
    base, _, _ = adapter_base(adapter, args.base, key="ADAPTER")
    # Before --force is looked at: --force replaces what the user had, never what merge reads.
    refuse_overlap({"--output": target}, {"ADAPTER": adapter, "the base": local_input(base)})
    if target.exists() and not args.force and (not target.is_dir() or any(target.iterdir())):
        raise UserError(Problem("--output", f"{target} exists and would be replaced",
                                fix="pass --force to replace it, or write to another directory"))
    faults.writable_target(target.parent, "--output", directory=True)
    with atomic.directory(target, "--output", "the merged model") as partial:
        base = merge(adapter, partial, args.base, args.dtype)
    print(f"wrote {target}: {base} with the adapter {args.adapter} merged in", file=sys.stderr)
    return 0
