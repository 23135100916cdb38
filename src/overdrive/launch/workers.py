"""The launcher/worker table: which entry each rank runs, the command line that re-enters it,
and starting the ranks under torch.distributed.run (the elastic agent). The one place that
builds a worker's command; the same run as other launchers' command lines: lines.py, job.py.

    run_on_ranks(resolved, "train", here=train)   # under the agent when the config needs it, else here

A command that runs on the ranks (train, preflight, profile, a tuner's or sweep's trial) calls
`run_on_ranks`: the resolved config is written once to `<output_dir>/resolved.json`, and the
agent starts `python -m overdrive.cli <entry> --resolved <file>` on every local rank, so every
rank runs exactly the same values and nothing is re-resolved in a different environment.

This module (with config/) is the only place that reads or writes os.environ: it decides
what each worker's environment holds.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from overdrive import strategies
from overdrive.config.schema import RunConfig
from overdrive.resolving.validate import launch_rules  # the same rules `overdrive explain` applies
from overdrive.errors import Problem, UserError
from overdrive.launch import lifetime, membership
from overdrive.launch.process import local_processes, needs_launcher, secrets_env, worker_environment


# --------------------------------------------------------------------------- checks


def problems(cfg: RunConfig, gpus: Optional[int] = None) -> list[Problem]:
    """World size and rendezvous problems, named by key, found before anything starts.
    `gpus`: judge for machines with that many GPUs (a script for a cluster), not this one."""
    return launch_rules(cfg) + strategies.problems(cfg, gpus=gpus)


def check(cfg: RunConfig, gpus: Optional[int] = None) -> None:
    found = problems(cfg, gpus)
    if found:
        raise UserError(found, title="cannot launch")


# --------------------------------------------------------------------------- commands


def port_in_use(port: int) -> bool:
    """Whether the rendezvous could not take `port`: checked by binding it on every address, as
    the store torchrun starts will (its standalone mode picks a port the same way). Connecting
    would miss a port still bound by a stopped job that accepts nothing. SO_REUSEADDR as c10d's
    store sets it: a port whose last job's connections linger in TIME_WAIT (a run killed and
    started again at once) is free to it, one another job listens on is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def port_chosen(resolved: Any) -> bool:
    """Whether launch.main_process_port was set by someone (a file, a variable, a key=value),
    rather than left at its default."""
    origin = (getattr(resolved, "origins", None) or {}).get("launch.main_process_port")
    return origin is not None and origin.layer != "default"


def own_port(cfg: RunConfig, chosen: bool) -> bool:
    """One machine, a port nobody chose: the rendezvous store binds port 0 and holds the port
    the system gives it, and the workers learn it from the agent (torchrun's standalone mode).
    Checking a port free and binding it later lets another job take it in between."""
    return cfg.launch.num_machines == 1 and not chosen and not membership.is_elastic(cfg)


def refuse_busy_port(cfg: RunConfig, chosen: bool) -> None:
    """A port the user chose on one machine that another job holds: refused by its key before
    anything starts, rather than inside torchrun."""
    launch = cfg.launch
    if launch.num_machines == 1 and chosen and port_in_use(launch.main_process_port):
        raise UserError(Problem("launch.main_process_port", f"port {launch.main_process_port} is in use on this "
                                "machine (another job holds it)", fix="choose another port, or remove the key: "
                                "a one-machine job then takes a port no other job can take"), title="cannot launch")


def torchrun_args(cfg: RunConfig, rendezvous: Optional[str] = None, regrouping: bool = False,
                  own: bool = False) -> list[str]:
    """Arguments for torch.distributed.run (before the worker command). `regrouping`: a new
    rendezvous of the machines still there, after one left (launch.min_machines). `own`: the
    rendezvous takes a port of its own (`own_port`)."""
    launch = cfg.launch
    backend = "c10d" if membership.is_elastic(cfg) else (rendezvous or launch.rdzv_backend)
    args = ["--nnodes", membership.nnodes(cfg, regrouping), "--nproc-per-node", str(local_processes(cfg)),
            "--max-restarts", str(launch.max_restarts), "--monitor-interval", str(launch.monitor_interval)]
    address = launch.main_process_ip or "127.0.0.1"
    if own:
        # Port 0: the store binds whatever port the system gives it and keeps it; the agent hands
        # that port (its shared store's) to the workers as MASTER_PORT. A run id of its own, so
        # no two jobs on this machine can meet in one rendezvous.
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id",
                 f"overdrive-{uuid.uuid4().hex[:12]}", "--local-addr", "127.0.0.1"]
    elif backend == "c10d":
        # Elastic: ranks are assigned by the rendezvous, so no machine needs to know its own.
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:{launch.main_process_port}",
                 "--rdzv-id", launch.rdzv_id]
        if regrouping:
            args += ["--rdzv-conf", f"last_call_timeout={membership.REJOIN_SECONDS}"]
    else:
        args += ["--node-rank", str(launch.machine_rank), "--master-addr", address,
                 "--master-port", str(launch.main_process_port)]
    return args


# The commands a rank re-enters with `--resolved` (cli.py's names), and `launch`: a user's script.
ENTRIES = ("train", "preflight", "profile", "launch")


def worker_command(entry: str, resolved_path: str | Path, *args: str) -> list[str]:
    """The interpreter arguments a rank runs: `entry` of overdrive's CLI on the resolved file."""
    if entry not in ENTRIES:
        raise ValueError(f"no worker entry {entry!r}: one of {', '.join(ENTRIES)}")
    handed = ["--worker" if entry == "launch" else "--resolved", str(resolved_path)]
    return ["-m", "overdrive.cli", entry, *handed, *args]


def train_worker(resolved_path: str | Path) -> list[str]:
    return worker_command("train", resolved_path)


def agent_command(cfg: RunConfig, worker: Sequence[str], regrouping: bool = False, own: bool = False) -> list[str]:
    """overdrive.launch.elastic (torch.distributed.run ending with one line naming a failed rank)
    starting `worker` on this machine's ranks (`own`: on a port of the rendezvous' own)."""
    return [sys.executable, "-m", "overdrive.launch.elastic", *torchrun_args(cfg, regrouping=regrouping, own=own),
            *worker]


def run_on_ranks(resolved: Any, entry: str, here: Callable[[Any], int], *args: str) -> int:
    """Run `entry` for `resolved`: on every rank under the agent when the config needs a launcher
    (several processes, or the GPUs in launch.gpu_ids), else `here(resolved)` in this process."""
    if needs_launcher(resolved.config):
        return int(launch_workers(resolved, worker=worker_command(entry, resolved_path(resolved.config), *args)) or 0)
    return int(here(resolved) or 0)


def resolved_path(cfg: RunConfig) -> Path:
    # Several launchers may share one output_dir (a shared file system, or two simulated
    # machines on one host): each machine writes its own copy so none reads another's.
    name = "resolved.json" if cfg.launch.machine_rank == 0 else f"resolved.machine{cfg.launch.machine_rank}.json"
    return Path(cfg.output_dir) / name


def launch_workers(resolved: Any, worker: Optional[Sequence[str]] = None,
                   extra_env: Optional[Mapping[str, str]] = None) -> int:
    """Start this machine's workers under the elastic agent; wait; return its exit code.

    Everything is checked before any process starts. `worker` replaces the default
    `-m overdrive.cli train --resolved <file>` (used by `overdrive launch` and tests).
    """
    cfg: RunConfig = resolved.config
    check(cfg)
    chosen = port_chosen(resolved)
    refuse_busy_port(cfg, chosen)
    path = resolved_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(resolved.to_json())  # secrets masked: the workers get them in their environment
    env = worker_environment(cfg)
    env.update(extra_env or {})
    env.update(secrets_env(cfg))
    # Restarts (launch.max_restarts) start a new agent rather than asking torch's agent to
    # restart its workers: its rendezvous store outlives the restart (torch 2.13, static and
    # c10d alike), and a restarted rank can read a dead peer's gloo address from it and fail
    # with "Connection refused". A new agent brings a new store. The workers resume from the
    # last checkpoint either way.
    once = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"max_restarts": 0})})
    allowed = membership.regroups_allowed(cfg)
    regrouping = False
    for attempt in range(allowed + 1):
        command = agent_command(once, worker if worker is not None else train_worker(path), regrouping,
                                own=own_port(cfg, chosen))
        code, hang = watched(cfg, lambda: run_agent(command, env))
        if hang:
            code = code if code >= 128 else 1
        # Done, stopped by a signal, or a problem the user must fix (exit 2: a full disk) that a restart would meet again.
        if code in (0, 2) or code >= 128 or attempt == allowed:
            return code
        regrouping = membership.regroup(cfg, code)
        if regrouping:
            print(f"overdrive: the job failed; rendezvous again with the machines still there "
                  f"({cfg.launch.min_machines} to {cfg.launch.num_machines}, {attempt + 1} of {allowed} regroups); "
                  "the workers resume from the last checkpoint", file=sys.stderr, flush=True)
        else:
            print(f"overdrive: restarting the workers ({attempt + 1} of {allowed} restarts); "
                  "they resume from the last checkpoint", file=sys.stderr, flush=True)
    return code


def watched(cfg: RunConfig, run: Any) -> tuple[int, bool]:
    """Run the agent with the hang watchdog beside it (`launch.hang_timeout_s`): (exit code, hung?)."""
    from overdrive.observe.nccl_room import over_nccl, watchdog_timeout_s
    from overdrive.observe.watchdog import Watchdog

    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    # Over NCCL: after NCCL's own timeout report and flight-recorder dump (observe/nccl_room.py).
    with Watchdog(cfg.output_dir, watchdog_timeout_s(cfg), cfg.launch.num_processes, say,
                  over_nccl=over_nccl(cfg)) as watchdog:
        code = run()
    return code, watchdog.hang is not None


FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def run_agent(command: Sequence[str], env: Mapping[str, str]) -> int:
    # A subprocess rather than torch.distributed.run.main() in this process: the workers
    # get exactly `env`, and this process's own environment and state stay untouched. The
    # agent follows this process (launch/lifetime.py): if it dies, the agent and workers end.
    process = subprocess.Popen(list(command), env={**env, **lifetime.launcher_env()})
    # A SIGTERM or SIGHUP sent to this process alone (`kill <pid>`, a scheduler, a closed
    # terminal) is passed on: the agent forwards it to the workers, which save a checkpoint and stop.
    forwarding = threading.current_thread() is threading.main_thread()  # handlers live in the main thread
    previous = {signum: signal.signal(signum, lambda signum, frame: process.send_signal(signum))
                for signum in FORWARDED} if forwarding else {}
    try:
        return process.wait()
    except KeyboardInterrupt:
        # The agent got the same SIGINT (same process group) and is stopping its workers:
        # give it time to do so rather than orphaning them.
        try:
            process.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            process.terminate()
            process.wait()
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
