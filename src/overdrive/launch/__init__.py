"""Starting processes: the environment of this process and its workers, torch.distributed.run
(the elastic agent), many machines, SLURM, users' own scripts, elastic restarts.

    process.py      the environment a worker (or a lone process) needs; build_accelerator
    workers.py      checks, torchrun arguments, the agent, restarts
    elastic.py      torch.distributed.run ending with one line naming the failed rank
    lifetime.py     every process ends with its parent: no worker outlives its launcher
    membership.py   elastic jobs (launch.min_machines): regrouping, the world a worker got
    job.py          one description of a job for every cluster writer; secrets referenced, never written
    k8s.py          Kubernetes manifests: TrainJob, PyTorchJob, JobSet
    skypilot.py     a SkyPilot task
    lines.py        the same run as torchrun / accelerate launch / srun lines and an sbatch script
    user_script.py  a user's own Accelerate script under the configured strategy
    tools.py        a venv's own commands (ninja for DeepSpeed's ops, python) first on PATH
"""
