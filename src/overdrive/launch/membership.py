"""Elastic jobs: a job that loses a machine goes on with the rest, keeping its global batch.

With `launch.min_machines` below `launch.num_machines` the job starts with every machine,
as any job does. When one leaves (killed, preempted), the survivors' workers stop: the
killed machine's workers stop after their step with a checkpoint (launch/lifetime.py) and the
stop is agreed by every rank, or, if the machine vanished outright, their next collective
fails as its connections close. Each surviving launcher then starts a new agent that
rendezvouses min:max (c10d) and waits `REJOIN_SECONDS` for the others before closing the
round. Its workers find a world smaller than the config's (`as_launched`), take the
accumulation that keeps the global batch, and resume from the newest checkpoint, resharded
for the new world by checkpoint/routes.py.

Whether a failed agent means a machine was lost is asked in one place, `regroup`: today
the rendezvous itself answers (a new round forms with whoever is there); a heartbeat watcher
that tells a lost machine from a slow one plugs in there.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from overdrive.config import Origin, batch
from overdrive.config.schema import RunConfig

# How long a regrouping agent waits for more machines once the fewest allowed have joined.
REJOIN_SECONDS = 5


def is_elastic(cfg: RunConfig) -> bool:
    launch = cfg.launch
    return launch.min_machines is not None and launch.min_machines < launch.num_machines


def nnodes(cfg: RunConfig, regrouping: bool) -> str:
    """torchrun's --nnodes: every machine to start; min:max when regrouping after a loss."""
    launch = cfg.launch
    if regrouping and is_elastic(cfg):
        return f"{launch.min_machines}:{launch.num_machines}"
    return str(launch.num_machines)


def regroups_allowed(cfg: RunConfig) -> int:
    """New agents a launcher may start after a failure: launch.max_restarts, plus one for
    each machine the job may lose."""
    extra = cfg.launch.num_machines - cfg.launch.min_machines if is_elastic(cfg) else 0
    return cfg.launch.max_restarts + extra


def regroup(cfg: RunConfig, code: int) -> bool:
    """Whether a failed agent (exit `code`) should be followed by a new rendezvous of the
    machines still there. The seam for a watcher that knows which machines are alive."""
    return is_elastic(cfg) and 0 < code < 128


def as_launched(resolved: Any) -> Any:
    """In a worker: the resolved config for the world the rendezvous formed (WORLD_SIZE,
    GROUP_WORLD_SIZE, GROUP_RANK from torch's agent). A smaller world than configured gets
    the accumulation that keeps the global batch, and the resume is judged again here, for
    this world (the launcher judged it for the full one)."""
    cfg: RunConfig = resolved.config
    world = int(os.environ.get("WORLD_SIZE") or cfg.launch.num_processes)
    if world == cfg.launch.num_processes or not is_elastic(cfg):
        return resolved
    machines = int(os.environ.get("GROUP_WORLD_SIZE") or max(world // max(cfg.launch.num_processes // cfg.launch.num_machines, 1), 1))
    why = Origin("elastic", f"the rendezvous formed {machines} of {cfg.launch.num_machines} machines ({world} process{'' if world == 1 else 'es'})")
    launch = cfg.launch.model_copy(update={
        "num_processes": world, "num_machines": machines, "machine_rank": int(os.environ.get("GROUP_RANK") or 0),
        "min_machines": min(cfg.launch.min_machines or machines, machines)})
    origins = dict(resolved.origins)
    for key in ("launch.num_processes", "launch.num_machines", "launch.machine_rank", "launch.min_machines"):
        origins[key] = why
    shrunk = cfg.model_copy(update={"launch": launch})
    split = batch.split(cfg)  # the full world's: the global batch to keep
    if split.micro is not None:
        # launch.min_machines was refused at start unless every machine count keeps it whole.
        accumulation = batch.keeping(split.global_batch, split.micro, batch.data_parallel_degree(shrunk))
        shrunk = batch.with_split(shrunk, split.micro, accumulation)
        origins[batch.ACCUMULATION] = why
    return replace(resolved, config=shrunk, origins=origins, resume=None)
