"""Starting the workers: torch.distributed.run (the elastic agent), many machines, user
scripts. The same run as other launchers' command lines and an sbatch script: launch_lines.py.

`overdrive train` with `launch.num_processes > 1` calls `launch_workers(resolved)`: the
resolved config is written to `<output_dir>/resolved.json`, and the elastic agent starts
`python -m overdrive.cli train --resolved <file>` on every local rank, so every rank runs
exactly the same values and nothing is re-resolved in a different environment.

This module (with config/) is the only place that reads or writes os.environ: it decides
what each worker's environment holds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

# Variables Accelerate reads to configure itself. The config's env layer has already folded
# them into the resolved config; a worker must not see them again, or a stale one would
# change the strategy behind the resolved values (plugins read them for any empty field).
STRIPPED_PREFIXES = ("ACCELERATE_", "FSDP_")
# With these set, Accelerate switches strategy or device by itself whenever no plugin says
# otherwise (and it sets the first two itself once a plugin is built, for the whole process).
STRATEGY_SWITCHES = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM",
                     "ACCELERATE_USE_CPU", "ACCELERATE_USE_PARALLELISM_CONFIG")


def local_processes(cfg: RunConfig) -> int:
    return max(cfg.launch.num_processes // max(cfg.launch.num_machines, 1), 1)


def threads_per_process(cfg: RunConfig) -> int:
    """torch intra-op threads per worker: configured, else this machine's cores shared out."""
    if cfg.launch.threads_per_process:
        return cfg.launch.threads_per_process
    return max(1, (os.cpu_count() or 1) // local_processes(cfg))


def needs_launcher(cfg: RunConfig) -> bool:
    return cfg.launch.num_processes > 1 or cfg.launch.num_machines > 1


def inside_worker() -> bool:
    """True in a process started by torch.distributed.run (or any launcher setting ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- checks


def problems(cfg: RunConfig) -> list[Problem]:
    """World size and rendezvous problems, named by key, found before anything starts."""
    from overdrive import strategies

    launch, found = cfg.launch, []
    if launch.num_processes % launch.num_machines:
        found.append(Problem("launch.num_processes", f"{launch.num_processes} processes do not divide evenly over "
                             f"{launch.num_machines} machines", fix="make it a multiple of launch.num_machines (it is the total)"))
    if launch.machine_rank >= launch.num_machines:
        found.append(Problem("launch.machine_rank", f"is {launch.machine_rank}, but ranks go 0..{launch.num_machines - 1}",
                             fix="set launch.machine_rank to this machine's index"))
    if launch.num_machines > 1 and not launch.main_process_ip:
        found.append(Problem("launch.main_process_ip", "must be set when launch.num_machines > 1",
                             fix="set launch.main_process_ip to the address of machine 0"))
    return found + strategies.problems(cfg)


def check(cfg: RunConfig) -> None:
    found = problems(cfg)
    if found:
        raise UserError(found, title="cannot launch")


# --------------------------------------------------------------------------- environment


def process_env(cfg: RunConfig) -> dict[str, str]:
    """Variables overdrive sets for a worker, from the config alone."""
    from overdrive.strategies import cpu

    env = {"OMP_NUM_THREADS": str(threads_per_process(cfg)), "MKL_NUM_THREADS": str(threads_per_process(cfg))}
    env.update(cpu.worker_env(cfg))
    if cfg.launch.debug:
        # Accelerate takes its debug switch from this variable only.
        env.update(ACCELERATE_DEBUG_MODE="true", TORCH_DISTRIBUTED_DEBUG="DETAIL")
    if cfg.launch.enable_cpu_affinity:
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    if cfg.launch.gpu_ids != "all" and not cfg.launch.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = cfg.launch.gpu_ids
    return env


def worker_environment(cfg: RunConfig, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """This process's environment minus Accelerate's variables, plus `process_env`."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith(STRIPPED_PREFIXES)}
    env.update(process_env(cfg))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def prepare_this_process(cfg: RunConfig) -> None:
    """Called by build_accelerator before anything imports deepspeed.

    Inside a worker the launcher already set everything; a lone process (one-process run,
    a notebook) gets DS_ACCELERATOR and, for DeepSpeed or FSDP, the rank variables of a
    one-member process group, as Accelerate's docs prescribe for single-process DeepSpeed.
    Either way Accelerate's strategy switches are removed: the config decides.
    """
    from overdrive.strategies import cpu

    # The config's environment layer has read these already; they must not act twice.
    for name in STRATEGY_SWITCHES:
        os.environ.pop(name, None)
    for key, value in cpu.worker_env(cfg).items():
        os.environ.setdefault(key, value)
    if cfg.parallel.strategy in ("deepspeed", "fsdp") and not inside_worker() and "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


# --------------------------------------------------------------------------- commands


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def local_port(cfg: RunConfig) -> RunConfig:
    """One machine: nobody else needs to know the rendezvous port, so a busy one (another
    run on this machine) is swapped for a free one instead of failing inside torchrun."""
    launch = cfg.launch
    if launch.num_machines > 1 or not port_in_use(launch.main_process_port):
        return cfg
    port = free_port()
    print(f"overdrive: port {launch.main_process_port} is in use; rendezvous on {port} instead "
          "(set launch.main_process_port to choose)", file=sys.stderr)
    return cfg.model_copy(update={"launch": launch.model_copy(update={"main_process_port": port})})


def torchrun_args(cfg: RunConfig, rendezvous: Optional[str] = None) -> list[str]:
    """Arguments for torch.distributed.run (before the worker command)."""
    launch = cfg.launch
    backend = rendezvous or launch.rdzv_backend
    args = ["--nnodes", str(launch.num_machines), "--nproc-per-node", str(local_processes(cfg)),
            "--max-restarts", str(launch.max_restarts), "--monitor-interval", str(launch.monitor_interval)]
    address = launch.main_process_ip or "127.0.0.1"
    if backend == "c10d":
        # Elastic: ranks are assigned by the rendezvous, so no machine needs to know its own.
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:{launch.main_process_port}",
                 "--rdzv-id", launch.rdzv_id]
    else:
        args += ["--node-rank", str(launch.machine_rank), "--master-addr", address,
                 "--master-port", str(launch.main_process_port)]
    return args


def train_worker(resolved_path: str | Path) -> list[str]:
    return ["-m", "overdrive.cli", "train", "--resolved", str(resolved_path)]


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
    path = resolved_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(resolved.to_json())
    env = worker_environment(cfg)
    env.update(extra_env or {})
    # Restarts (launch.max_restarts) start a new agent rather than asking torch's agent to
    # restart its workers: its rendezvous store outlives the restart (torch 2.13, static and
    # c10d alike), and a restarted rank can read a dead peer's gloo address from it and fail
    # with "Connection refused". A new agent brings a new store. The workers resume from the
    # last checkpoint either way.
    once = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"max_restarts": 0})})
    for attempt in range(cfg.launch.max_restarts + 1):
        # overdrive.elastic is torch.distributed.run ending with one line naming a failed rank.
        command = [sys.executable, "-m", "overdrive.elastic", *torchrun_args(local_port(once)),
                   *(worker if worker is not None else train_worker(path))]
        code = run_agent(command, env)
        if code == 0 or code >= 128 or attempt == cfg.launch.max_restarts:  # done, or stopped by a signal
            return code
        print(f"overdrive: restarting the workers ({attempt + 1} of {cfg.launch.max_restarts} restarts); "
              "they resume from the last checkpoint", file=sys.stderr, flush=True)
    return code


def run_agent(command: Sequence[str], env: Mapping[str, str]) -> int:
    # A subprocess rather than torch.distributed.run.main() in this process: the workers
    # get exactly `env`, and this process's own environment and state stay untouched.
    process = subprocess.Popen(list(command), env=dict(env))
    # A SIGTERM sent to this process alone (`kill <pid>`, a scheduler) is passed on: the
    # agent forwards it to the workers, which save a checkpoint and stop.
    forwarding = threading.current_thread() is threading.main_thread()  # handlers live in the main thread
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum)) if forwarding else None
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
        if forwarding:
            signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- user scripts


def user_script_env(cfg: RunConfig, files_dir: Path) -> dict[str, str]:
    """The environment a bare `Accelerator()` in a user's script configures itself from.

    Built by Accelerate's own launcher code (`_validate_launch_command` and the
    `prepare_*_env` functions) from the Accelerate YAML and DeepSpeed JSON that
    `overdrive export` writes into `files_dir`, so the variable names and values are exactly
    those `accelerate launch` would set. Added on top: what `accelerate launch` leaves out
    but Accelerate reads (the accumulation for non-DeepSpeed runs), and the CPU facts.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (prepare_deepspeed_cmd_env, prepare_multi_gpu_env,
                                         prepare_simple_launcher_cmd_env)

    from overdrive import export
    from overdrive.strategies import cpu

    files_dir = files_dir.resolve()
    files_dir.mkdir(parents=True, exist_ok=True)
    acc_path = files_dir / "accelerate.yaml"
    ds_path = files_dir / "deepspeed.json" if cfg.parallel.strategy == "deepspeed" else None
    # Batch sizes stay "auto": the script's own DataLoader decides them. Bucket sizes come
    # from the configured model, since the script's model may have no `config` to fill them.
    from overdrive.strategies.deepspeed import hidden_size_of

    hidden = hidden_size_of(cfg) if ds_path else None
    export.write(cfg, acc_path, ds_path, batch_auto=True, hidden_size=hidden)

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(STRIPPED_PREFIXES)}
    try:  # Accelerate's functions start from os.environ: start them from a clean one
        args = launch_command_parser().parse_args(["--config_file", str(acc_path), "overdrive-user-script"])
        args, defaults, _ = _validate_launch_command(args)
        # Only ever started by us, on a port chosen by the config: skip their port probe.
        args.main_process_port = cfg.launch.main_process_port
        if args.use_deepspeed:
            args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
            _, env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            env = prepare_multi_gpu_env(args)
        else:
            _, env = prepare_simple_launcher_cmd_env(args)
    finally:
        os.environ.update(saved)
    env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(cfg.training.gradient_accumulation_steps)
    if cpu.construct_with_cpu_flag(cfg):
        env["ACCELERATE_USE_CPU"] = "true"
    env.update(process_env(cfg))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launch_script(resolved: Any, script: str, script_args: Sequence[str]) -> int:
    """Run a user's Accelerate script on every configured process (any process count).

    Each worker enters `overdrive launch --worker`, which applies the CPU workarounds around
    the script's own `Accelerator()` (strategies/cpu.py) and then runs the script.
    """
    cfg: RunConfig = resolved.config
    check(cfg)
    cfg = local_port(cfg)
    files_dir = Path(cfg.output_dir) / "launch"
    env = user_script_env(cfg, files_dir)
    path = files_dir / resolved_path(cfg).name
    path.write_text(resolved.to_json())
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg),
               "-m", "overdrive.cli", "launch", "--worker", str(path), script, *script_args]
    return run_agent(command, env)


def run_user_script(resolved_file: str, script: str, script_args: Sequence[str]) -> int:
    """Inside a worker: the script runs as `__main__`, with its own argv."""
    import runpy

    from overdrive.config import Resolved
    from overdrive.strategies import cpu

    cfg = Resolved.from_json(Path(resolved_file).read_text()).config
    cpu.apply_to_user_accelerators(cfg)
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    # The script has finished: run its exit handlers, flush, and leave without interpreter
    # finalisation. Tearing down native thread pools there intermittently aborts a worker
    # that has already done all its work ("terminate called without an active exception",
    # SIGABRT), and the elastic agent then fails the whole job.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
