"""This process and its workers: their environment, decided from the run config alone.

With config/, this package is the only place that reads or writes os.environ: it decides
what each worker's environment holds, and prepares a lone process (a one-process run, a
notebook) the way the launcher prepares a worker.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from overdrive.config.schema import RunConfig
from overdrive.observe import nccl_room
from overdrive.strategies import cpu, registry

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
    """Several processes, or one on chosen GPUs: the launcher's workers get CUDA_VISIBLE_DEVICES
    before anything in them touches CUDA (in this process, hardware checks already have)."""
    chosen_gpus = cfg.launch.gpu_ids != "all" and not cfg.launch.use_cpu
    return cfg.launch.num_processes > 1 or cfg.launch.num_machines > 1 or chosen_gpus


def inside_worker() -> bool:
    """True in a process started by torch.distributed.run (or any launcher setting ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def process_env(cfg: RunConfig, elsewhere: bool = False) -> dict[str, str]:
    """Variables overdrive sets for a worker, from the config alone.

    `elsewhere`: for a script that runs on other machines (sbatch, printed command lines).
    Then nothing is taken from this machine: CPU or GPU follows the config
    (`cpu.target_gpus`), and the thread count is left to the script unless configured.
    """
    env: dict[str, str] = {}
    if cfg.launch.threads_per_process or not elsewhere:
        env.update(OMP_NUM_THREADS=str(threads_per_process(cfg)), MKL_NUM_THREADS=str(threads_per_process(cfg)))
    gpus = cpu.target_gpus(cfg) if elsewhere else None
    env.update(cpu.worker_env(cfg, gpus))
    env.update(nccl_room.flight_recorder_env(cfg, gpus))  # NCCL's timeout report says which rank stopped where
    if cfg.launch.debug:
        # Accelerate takes its debug switch from this variable only.
        env.update(ACCELERATE_DEBUG_MODE="true", TORCH_DISTRIBUTED_DEBUG="DETAIL")
    if cfg.launch.enable_cpu_affinity:
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    if cfg.launch.use_cpu:
        # Hidden, so that Accelerate, DeepSpeed and FSDP's device mesh all agree on the CPU
        # (with GPUs visible, Accelerate would put batches on cuda:N while DeepSpeed runs on CPU).
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif cfg.launch.gpu_ids != "all":
        env["CUDA_VISIBLE_DEVICES"] = cfg.launch.gpu_ids
    return env


def worker_environment(cfg: RunConfig, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """This process's environment minus Accelerate's variables, plus `process_env`."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if not k.startswith(STRIPPED_PREFIXES)}
    env.update(process_env(cfg))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def secrets_env(cfg: RunConfig) -> dict[str, str]:
    """The config's secrets for the workers' environment: the resolved file they read holds
    them masked, and a credential belongs in a process's environment, not in a file."""
    import json

    from overdrive.resolving import SECRETS_VARIABLE, Resolved

    secrets = Resolved(config=cfg, origins={}).secret_values()
    return {SECRETS_VARIABLE: json.dumps(secrets)} if secrets else {}


def hide_gpus_for_cpu_runs(cfg: RunConfig) -> None:
    """`launch.use_cpu` in a lone process: hide the GPUs, as the launcher does for workers.
    Effective only before CUDA is initialised here (`overdrive train` calls this before its
    hardware check asks torch; a notebook that already used a GPU keeps seeing it)."""
    if cfg.launch.use_cpu and not inside_worker():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def prepare_this_process(cfg: RunConfig) -> None:
    """Called by build_accelerator before anything imports deepspeed.

    Inside a worker the launcher already set everything; a lone process (one-process run,
    a notebook) gets DS_ACCELERATOR and, for DeepSpeed or FSDP, the rank variables of a
    one-member process group, as Accelerate's docs prescribe for single-process DeepSpeed.
    Either way Accelerate's strategy switches are removed: the config decides.
    """
    # The config's environment layer has read these already; they must not act twice.
    for name in STRATEGY_SWITCHES:
        os.environ.pop(name, None)
    hide_gpus_for_cpu_runs(cfg)
    for key, value in cpu.worker_env(cfg).items():
        os.environ.setdefault(key, value)
    if registry.of(cfg).always_grouped and not inside_worker() and "RANK" not in os.environ:
        # Port 0: the group's store binds a port of its own and keeps it (a port checked free and
        # bound later can be taken by another job in between); nobody else needs to find it.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def build_accelerator(cfg: RunConfig, world_size: Optional[int] = None, **extra_kwargs: Any):
    """An Accelerator configured from `cfg` alone, in a process prepared for it.

    The process environment comes first: DeepSpeed reads DS_ACCELERATOR once, when it is
    first imported (while its plugin is built), and a lone process running DeepSpeed or FSDP
    needs the rank variables of a one-member process group. Then strategies/ builds every
    plugin from the config and constructs the Accelerator.
    """
    from overdrive.strategies import construct_accelerator

    prepare_this_process(cfg)
    return construct_accelerator(cfg, world_size, **extra_kwargs)


def quiet_deprecated_collectives() -> None:
    """DeepSpeed calls torch.distributed collectives torch has deprecated: a FutureWarning per
    call, on every rank, naming nothing the user can change. Called where a rank starts work
    (the training loop, a user's script)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger")
