"""`overdrive import FILE... -o run.yaml`: Accelerate, DeepSpeed, Axolotl, LLaMA-Factory and torchtune
files -> an overdrive config.

The files are read as config layers (as `overdrive train FILE` would read them) and only the
values that differ from overdrive's defaults are written.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="Accelerate YAML/JSON, DeepSpeed JSON, Axolotl, LLaMA-Factory or torchtune YAML")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the overdrive YAML here (default: stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")


def run(args: argparse.Namespace) -> int:
    import yaml

    from overdrive.interop import writing as export
    from overdrive.resolving import resolve
    import sys

    from overdrive.config.redact import redact
    from overdrive.resolving.inputs import tell_warnings
    from overdrive.storage import faults

    from overdrive.storage.overlap import refuse_overlap

    if args.output:
        refuse_overlap({"--output": args.output}, {f"FILE {i + 1}": f for i, f in enumerate(args.files)})
        args.output = str(faults.output_file(args.output, "--output", args.force))
    # Only the files: neither Accelerate's default config nor this shell's variables.
    resolved = resolve(args.files, env={}, accelerate_default=False)
    # Messages to stderr: `overdrive import x > run.yaml` must leave a valid file.
    tell_warnings(resolved.warnings)
    settings = redact(export.imported_settings(resolved))
    if "output_dir" not in settings:  # a directory of its own, not every import's runs/default
        from overdrive.wizard.files import own_output_dir

        settings = {"output_dir": own_output_dir(args.output or args.files[0]), **settings}
    header = f"# overdrive run config imported from {', '.join(args.files)}\n"
    text = header + (yaml.safe_dump(settings, sort_keys=False) if settings else "{}\n")
    if args.output:
        faults.write_text(args.output, text, "--output")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    return 0
