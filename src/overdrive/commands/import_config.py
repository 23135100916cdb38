"""`overdrive import FILE... [KEY=VALUE ...] -o run.yaml`: Accelerate, DeepSpeed, Axolotl, LLaMA-Factory
and torchtune files -> an overdrive config.

The files are read as config layers (as `overdrive train FILE` would read them) and only the
values that differ from overdrive's defaults are written. KEY=VALUE items are applied over the
files and written too: what a file cannot say here (a LLaMA-Factory data set named in a
dataset_info.json that is not at hand) is given as `data.source=...`, and the refusal it
answers is dropped.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE | KEY=VALUE",
                        help="Accelerate YAML/JSON, DeepSpeed JSON, Axolotl, LLaMA-Factory or torchtune YAML; then "
                        "dotted overrides written into the config too (data.source=data.jsonl)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the overdrive YAML here (default: stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")


def run(args: argparse.Namespace) -> int:
    import yaml

    from overdrive.interop import writing as export
    import sys

    from overdrive.config.redact import redact
    from overdrive.resolving.inputs import resolve_items, split_items
    from overdrive.storage import faults

    from overdrive.storage.overlap import refuse_overlap

    files, _ = split_items(args.files)
    if not files:
        from overdrive.errors import Problem, UserError

        raise UserError(Problem("FILE", "no file to import, only KEY=VALUE items",
                                fix="name the tool's config file first: overdrive import FILE KEY=VALUE -o run.yaml"))
    if args.output:
        refuse_overlap({"--output": args.output}, {f"FILE {i + 1}": f for i, f in enumerate(files)})
        args.output = str(faults.output_file(args.output, "--output", args.force))
    # Only the files and the items typed: neither Accelerate's default config nor this shell's
    # variables. Messages go to stderr: `overdrive import x > run.yaml` must leave a valid file.
    resolved = resolve_items(args.files, accelerate_default=False, env={})
    imported = export.imported_settings(resolved)
    settings = redact(imported)
    _say_masked(imported, settings, args.output or "the config")
    if "output_dir" not in settings:  # a directory of its own, not every import's runs/default
        from overdrive.wizard.files import own_output_dir

        settings = {"output_dir": own_output_dir(args.output or files[0]), **settings}
    header = f"# overdrive run config imported from {', '.join(files)}\n"
    text = header + (yaml.safe_dump(settings, sort_keys=False) if settings else "{}\n")
    if args.output:
        faults.write_text(args.output, text, "--output")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def _say_masked(imported: dict, written: dict, target: str) -> None:
    """One warning per value whose credential the written file leaves out (`train` refuses it by key)."""
    import sys

    from overdrive.config.keys import flatten

    before = flatten(imported)
    for key, value in flatten(written).items():
        if value != before.get(key):
            print(f"overdrive: warning: {key}: a credential is masked in {target} ({value!r}); train refuses it "
                  f"until the real value is given: {key}=... on the command line, or HF_TOKEN for the hub",
                  file=sys.stderr)
