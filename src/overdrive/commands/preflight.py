"""`overdrive preflight [FILES...] [key=value ...]`

Before training, through the job's own launcher and rendezvous: the rendezvous completes;
all-reduce and all-gather bandwidth and latency against the traffic the configured step
needs; every rank sees output_dir, with free disk for a checkpoint; the same library
versions and the same resolved config on every machine; the rendezvous port free on
machine 0. A table; exit 2 naming the key or the machine on a failure.
`overdrive train --preflight` runs it first.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="FILE | KEY=VALUE",
                        help="config files (applied in order) and dotted overrides, as for `overdrive train`")
    parser.add_argument("--resolved", metavar="PATH",
                        help="check exactly this resolved config (written by the launcher for its workers)")
    from overdrive.commands.arguments import add_accelerate_default_argument

    add_accelerate_default_argument(parser)


def run(args: argparse.Namespace) -> int:
    from overdrive.commands.arguments import load_run as _load

    resolved, in_worker = _load(args)
    if in_worker:
        from overdrive.observe.preflight import run_checks

        run_checks(resolved.config)
        return 0
    from overdrive.launch.preflight import preflight

    return preflight(resolved)
