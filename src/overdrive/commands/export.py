"""`overdrive export CONFIG --accelerate acc.yaml --deepspeed ds.json`

Writes the Accelerate YAML and DeepSpeed JSON that `accelerate launch` accepts for the same
run; `overdrive import` reads them back. `--peft DIR` writes the `peft:` section as PEFT's own
adapter_config.json (`LoraConfig.from_pretrained(DIR)` reads it) for a Trainer or TRL script
that builds its adapter itself.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.arguments import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--accelerate", metavar="FILE", help="write an Accelerate config (YAML) here")
    parser.add_argument("--deepspeed", metavar="FILE", help="write the DeepSpeed config (JSON) here")
    parser.add_argument("--peft", metavar="DIR", help="write the peft section as PEFT's adapter_config.json here "
                        "(LoraConfig.from_pretrained(DIR) loads it)")
    parser.add_argument("--batch-auto", action="store_true",
                        help='leave the DeepSpeed batch sizes "auto" (the script\'s DataLoader decides them)')
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")


def run(args: argparse.Namespace) -> int:
    from overdrive.interop import writing as export
    from overdrive.commands.arguments import resolved_from
    import sys
    from pathlib import Path

    from overdrive.errors import Problem, UserError
    from overdrive.storage.faults import output_file, writable_target

    if not args.accelerate and not args.deepspeed and not args.peft:
        raise UserError("nothing to write: give --accelerate FILE, --deepspeed FILE and/or --peft DIR")
    if args.accelerate and args.deepspeed and Path(args.accelerate).resolve() == Path(args.deepspeed).resolve():
        raise UserError(Problem("--deepspeed", f"is the same file as --accelerate ({args.deepspeed}): one would "
                                "overwrite the other", fix="give the two files different names"))
    # The config first: a refusal by key leaves no directory made for a file never written.
    cfg = resolved_from(args).config
    from overdrive.storage.overlap import local_input, refuse_overlap

    # --peft DIR adds one file to DIR: that file is what must not be an input.
    refuse_overlap({"--accelerate": args.accelerate, "--deepspeed": args.deepspeed,
                    "--peft": str(Path(args.peft) / "adapter_config.json") if args.peft else None},
                   {f"FILE {item}": local_input(item) for item in args.items if "=" not in item})
    peft = None
    if args.peft:
        from overdrive.hf import peft_config

        peft = peft_config(cfg)
        if peft is None:
            raise UserError(Problem("peft.method", "is none: there is no adapter to describe",
                                    fix="set peft.method=lora (or qlora)"))
    if args.accelerate:
        args.accelerate = str(output_file(args.accelerate, "--accelerate", args.force))
    if args.deepspeed:
        args.deepspeed = str(output_file(args.deepspeed, "--deepspeed", args.force))
    peft_file = None
    if args.peft:
        args.peft = str(writable_target(args.peft, "--peft", directory=True))
        peft_file = str(output_file(Path(args.peft) / "adapter_config.json", "--peft", args.force))
    if args.accelerate or args.deepspeed:
        for path in export.write(cfg, args.accelerate, args.deepspeed, batch_auto=args.batch_auto):
            print(f"wrote {path}", file=sys.stderr)
    if peft is not None:
        peft.save_pretrained(args.peft)
        print(f"wrote {peft_file}", file=sys.stderr)
    return 0
