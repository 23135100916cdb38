"""The same run as other launchers would start it: torchrun, `accelerate launch`, srun, and
an sbatch script (`overdrive train --print-launch`, `overdrive slurm`)."""

from __future__ import annotations

from overdrive.console import counted

import shlex
from pathlib import Path
from typing import Any, Sequence

from overdrive.config.schema import RunConfig
from overdrive.strategies.cpu import target_gpus
from overdrive.launch import membership
from overdrive.launch.job import secret_variables
from overdrive.launch.process import STRIPPED_PREFIXES, local_processes, process_env
from overdrive.launch.workers import check, resolved_path, torchrun_args, train_worker


def _quote(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def launch_lines(resolved: Any) -> dict[str, str]:
    """The same run as torchrun, `accelerate launch` and srun command lines."""
    from overdrive.interop import writing as export
    cfg: RunConfig = resolved.config
    path = resolved_path(cfg)
    env = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(process_env(cfg, elsewhere=True).items())),
                    *_threads_on_the_node(cfg)])
    worker = train_worker(path)
    torchrun = f"{env} torchrun {_quote(_standalone_torchrun_args(cfg))} {_quote(worker)}"
    accelerate = f"{env} accelerate launch {_quote(export.accelerate_flags(cfg))} {_quote(worker)}"
    srun = ('MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
            f"srun --nodes={cfg.launch.num_machines} --ntasks-per-node=1 bash -c "
            + shlex.quote(f"{env} python -m torch.distributed.run {_slurm_torchrun(cfg)} {_quote(worker)}"))
    return {"torchrun": torchrun, "accelerate": accelerate, "srun": srun}


def _standalone_torchrun_args(cfg: RunConfig) -> list[str]:
    """torchrun started by hand on each machine. Elastic (launch.min_machines): no overdrive
    launcher is there to regroup the machines left after a loss, so torchrun does it itself with
    min:max machines and one restart more per machine the job may lose, as in the srun line.
    The short wait for latecomers of overdrive's own regrouping is left out: machines typed in
    by hand seconds apart would start a smaller job (torch waits its default 30 s for them)."""
    if not membership.is_elastic(cfg):
        return torchrun_args(cfg)
    args = torchrun_args(cfg, regrouping=True)
    args[args.index("--max-restarts") + 1] = str(membership.regroups_allowed(cfg))
    conf = args.index("--rdzv-conf")
    del args[conf:conf + 2]
    return args


def _threads_on_the_node(cfg: RunConfig) -> list[str]:
    """OMP/MKL threads counted where the command runs (its cores shared by its processes),
    unless launch.threads_per_process says; never this machine's count (a login node's)."""
    if cfg.launch.threads_per_process:
        return []
    n = local_processes(cfg)
    share = f"$(( $(nproc) / {n} > 0 ? $(nproc) / {n} : 1 ))"
    return [f"OMP_NUM_THREADS={share}", f"MKL_NUM_THREADS={share}"]


def _slurm_torchrun(cfg: RunConfig) -> str:
    # Under SLURM the first node of the allocation is the rendezvous host and c10d assigns
    # ranks, so one script serves every node.
    launch = cfg.launch
    # Elastic (launch.min_machines): torchrun's own min:max, so the job goes on when a node leaves.
    return (f"--nnodes {membership.nnodes(cfg, regrouping=True)} --nproc-per-node {local_processes(cfg)} "
            f"--max-restarts {membership.regroups_allowed(cfg)} --rdzv-backend c10d "
            f"--rdzv-endpoint \"$MASTER_ADDR:{launch.main_process_port}\" --rdzv-id \"$SLURM_JOB_ID\"")


def _secrets_line(resolved: Any) -> str:
    # resolved.json below has its secrets masked; the job takes them from the environment
    # sbatch passes on, never from the script on disk.
    lines = [f': "${{{s.name}:?export {s.name} ({s.holds}) before sbatch: resolved.json holds them masked}}"\n'
             for s in secret_variables(resolved) if s.required]
    return "".join(lines)


def sbatch_script(resolved: Any, job_name: str = "overdrive") -> str:
    """An sbatch script for the same run. It carries the resolved config itself, so the job
    runs the values resolved now, whatever the compute nodes' environment holds."""
    cfg: RunConfig = resolved.config
    launch = cfg.launch
    out = Path(cfg.output_dir).resolve()
    path = out / "resolved.json"
    gpus = target_gpus(cfg)
    gpu_line = f"#SBATCH --gpus-per-node={gpus}\n" if gpus else ""
    # Cores: as configured, else whole nodes whose cores the processes share (counted there).
    cpus_line = (f"#SBATCH --cpus-per-task={launch.threads_per_process * local_processes(cfg)}\n"
                 if launch.threads_per_process else "#SBATCH --exclusive\n")
    exports = "\n".join([*(f"export {k}={shlex.quote(v)}" for k, v in sorted(process_env(cfg, elsewhere=True).items())),
                         *(f"export {assignment}" for assignment in _threads_on_the_node(cfg))])
    unset = " ".join(f"${{!{p}@}}" for p in STRIPPED_PREFIXES)
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={launch.num_machines}
#SBATCH --ntasks-per-node=1
{gpu_line}{cpus_line}#SBATCH --output=slurm-%x-%j.out
# Written by `overdrive slurm`: {counted(launch.num_processes, 'process')} on {counted(launch.num_machines, 'machine')},
# strategy {cfg.parallel.strategy}, {f"{counted(gpus, 'GPU')} per machine" if gpus else "CPU only"} (launch.gpus_per_machine,
# launch.use_cpu). output_dir must be on a file system every node sees. The log goes to the
# directory sbatch is run from: Slurm opens it before this script can create output_dir.
# Cores: whole nodes (--exclusive) unless launch.threads_per_process asks for a number per process.
set -euo pipefail
{_secrets_line(resolved)}
mkdir -p {shlex.quote(str(out))}
cat > {shlex.quote(str(path))} <<'OVERDRIVE_RESOLVED'
{resolved.to_json()}
OVERDRIVE_RESOLVED

# Accelerate's own variables are already part of the resolved config above.
for name in {unset}; do unset "$name"; done
{exports}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

srun python -m torch.distributed.run {_slurm_torchrun(cfg)} \\
    {_quote(train_worker(path))}
"""


def print_launch(resolved: Any) -> int:
    """`overdrive train --print-launch`: the same run as other launchers would start it."""
    check(resolved.config, gpus=target_gpus(resolved.config))  # the machines it runs on, not this one
    lines = launch_lines(resolved)
    print(f"# workers read {resolved_path(resolved.config)} (written by `overdrive train` when it launches)")
    notes = {}
    if membership.is_elastic(resolved.config):
        launch = resolved.config.launch
        notes["accelerate"] = (f"# (accelerate launch starts exactly {launch.num_machines} machines: it has no min:max, "
                               f"so launch.min_machines={launch.min_machines} does not apply to this line)\n")
    for name in ("torchrun", "accelerate", "srun"):
        print(f"\n# {name}\n{notes.get(name, '')}{lines[name]}")
    return 0
