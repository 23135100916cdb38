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
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="FILE | KEY=VALUE",
                        help="config files (applied in order) and dotted overrides, as for `overdrive train`")
    parser.add_argument("--resolved", metavar="PATH",
                        help="check exactly this resolved config (written by the launcher for its workers)")


def run(args: argparse.Namespace) -> int:
    from overdrive.commands.arguments import load_run as _load

    resolved, in_worker = _load(args)
    if in_worker:
        from overdrive.observe.preflight import run_checks

        run_checks(resolved.config, config_values(resolved.config))
        return 0
    return preflight(resolved)


def config_values(cfg) -> dict:
    from overdrive.config.keys import flatten
    from overdrive.config.redact import redact

    return {k: json.dumps(v, sort_keys=True) for k, v in flatten(redact(cfg.model_dump(mode="json"))).items()}


def preflight(resolved) -> int:
    """The checks for `resolved`, from the launcher's side: 0, or UserError (exit 2)."""
    from overdrive.errors import Problem, UserError
    from overdrive.storage.faults import writable_target
    from overdrive.launch import workers
    from overdrive.observe.preflight import result_path, run_checks
    from overdrive.observe.preflight_report import render

    cfg = resolved.config
    workers.check(cfg)
    writable_target(cfg.output_dir, "output_dir", directory=True)
    launch = cfg.launch
    if launch.num_machines > 1 and launch.machine_rank == 0 and workers.port_in_use(launch.main_process_port):
        raise UserError(Problem("launch.main_process_port", f"port {launch.main_process_port} is already in use on "
                                "this machine (machine 0), so the rendezvous cannot listen there",
                                fix="choose a free port for every machine, or stop what holds it"),
                        title="preflight failed")
    path = result_path(cfg.output_dir, launch.machine_rank)
    path.unlink(missing_ok=True)
    here: list[dict] = []  # the verdict of a run in this process; the workers' is read from `path`
    code = workers.run_on_ranks(resolved, "preflight", lambda _: here.append(run_checks(cfg, config_values(cfg))))
    if not here and (code or not path.exists()):
        print(f"overdrive: preflight: the workers did not complete the checks (exit {code}); "
              "their output above says why", file=sys.stderr)
        return code or 1
    verdict = here[0] if here else json.loads(path.read_text())
    print(render(verdict))
    if verdict["problems"]:
        raise UserError([Problem(p["key"], p["message"], fix=p["fix"]) for p in verdict["problems"]],
                        title="preflight failed")
    return 0
