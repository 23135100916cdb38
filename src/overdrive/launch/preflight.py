"""`overdrive preflight` from the launcher's side: the checks run on every rank through the
job's own launcher and rendezvous (observe/preflight.py), the verdict shown, a failure a
UserError naming the key or the machine. `overdrive train --preflight` runs it first."""

from __future__ import annotations

import json
import sys


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
    code = workers.run_on_ranks(resolved, "preflight", lambda _: here.append(run_checks(cfg)))
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
