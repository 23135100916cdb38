"""The run's config as `train`, `preflight`, `profile`, `plan` and `slurm` read it: from files and
key=value items, or whole from a worker's --resolved file; and what the loop cannot run,
refused before any process starts."""

from __future__ import annotations

import sys


def load_run(args):
    """(Resolved, in_worker) for a command's `items` (files and key=value) or `--resolved`."""
    from overdrive.resolving import Resolved, resolve
    from overdrive.errors import UserError

    files = [item for item in args.items if "=" not in item]
    cli = [item for item in args.items if "=" in item]
    if args.resolved:
        if args.items:
            raise UserError(f"--resolved carries the whole config; drop {' '.join(args.items)}")
        from overdrive.config.sources import read_text

        text = read_text(args.resolved, "resolved config (--resolved)")
        return Resolved.from_json(text, where=str(args.resolved)), True
    resolved = resolve(files, cli=cli)
    from overdrive.config.redact import redact_text

    for warning in resolved.warnings:
        print(f"overdrive: warning: {redact_text(warning.render())}", file=sys.stderr)
    return resolved, False


def check_model_layout(cfg) -> None:
    """The model's heads and tensor-parallel plan against parallel.tp_size / sp_size, read
    from its config alone (no weights), and what the loop does not do (sequence parallel),
    before any process starts."""
    from overdrive.errors import UserError
    from overdrive.strategies import layout

    lay = layout.layout(cfg)
    if lay.tp == 1 and lay.sp == 1:
        return
    from overdrive.memory.model_shape import hf_config_for_run

    found = layout.loop_problems(cfg) + layout.model_problems(cfg, hf_config_for_run(cfg))
    if found:
        raise UserError(found)
