"""The `launch:` section: processes, machines, rendezvous, restarts and what a job may lose."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from overdrive.config.sections import Section


class LaunchConfig(Section):
    """Processes and machines."""

    num_processes: int = Field(1, ge=1, description="Total processes across all machines.")
    num_machines: int = Field(1, ge=1, description="Machines taking part.")
    machine_rank: int = Field(0, ge=0, description="This machine's rank, 0 .. num_machines-1.")
    min_machines: Optional[int] = Field(
        None, ge=1, description="Elastic: the job goes on with this many machines when others leave (c10d "
        "rendezvous min:max; it resumes from the last checkpoint with the accumulation that keeps the global batch). "
        "Empty: launch.num_machines (every machine is needed)."
    )
    main_process_ip: Optional[str] = Field(None, description="Address of machine 0 (required with several machines).")
    main_process_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on machine 0. Left unset, "
                                   "a one-machine job's rendezvous takes a port of its own that no other job can "
                                   "take; set, a port another job holds is refused before launch.")
    rdzv_backend: Literal["static", "c10d"] = Field("static", description="Rendezvous: static ranks, or c10d (elastic).")
    rdzv_id: str = Field("overdrive", description="Job id shared by all machines (c10d rendezvous).")
    same_network: bool = Field(True, description="Machines share a network (informational, as in Accelerate).")
    max_restarts: int = Field(0, ge=0, description="Times the elastic agent restarts failed workers (they resume from the last checkpoint).")
    monitor_interval: float = Field(0.1, gt=0, description="Seconds between the agent's health checks of its workers "
                                    "(torchrun's and `accelerate launch`'s default: a finished or failed job is seen at once).")
    hang_timeout_s: Optional[float] = Field(
        600.0, gt=0, description="Seconds without progress on any rank after which the job is declared hung: the "
        "stuck rank(s), the step and phase each was last seen in, and every rank's Python stack are printed, then the "
        "job ends (or restarts from the last checkpoint, `max_restarts`). Empty: no watchdog. Raise it when one rank "
        "alone does long work (a huge checkpoint) while the others wait. Over NCCL it waits at least until NCCL's own "
        "timeout (`launch.timeout_minutes`) and a minute more, so NCCL's report and its flight recorder's dump "
        "(`<output_dir>/nccl_trace/`) come first."
    )
    stop_timeout: float = Field(
        30.0, gt=0, description="Seconds a worker whose launcher is gone (killed, its terminal closed) has to finish "
        "its step and save a checkpoint before it is killed. A user's script gets SIGTERM, then SIGKILL after this long."
    )
    use_cpu: bool = Field(False, description="Train on the CPU even when a GPU is present (the GPUs are hidden from the workers).")
    gpus_per_machine: Optional[int] = Field(
        None, ge=0, description="GPUs on each machine the job runs on. Empty: detected where it runs; scripts written "
        "for another machine (`overdrive slurm`, `--print-launch`) then assume one GPU per process unless "
        "`launch.use_cpu`. 0 says the machines have none."
    )
    gpu_ids: str = Field("all", description="GPUs to use on each machine (`all` or a comma list).")
    image: Optional[str] = Field(
        None, description="Container image the job runs in (`overdrive k8s`, `overdrive skypilot`), with overdrive "
        "and torch installed."
    )
    kubeflow_trainer_version: Literal["2.0", "2.1", "2.2", "2.3"] = Field(
        "2.3", description="Kubeflow Trainer release the cluster runs (`overdrive k8s --kind trainjob`): the volumes "
        "reach the runtime's pods through `runtimePatches` (2.2, 2.3), `podTemplateOverrides` (2.1) or "
        "`podSpecOverrides` (2.0); each release's TrainJob CRD rejects the others' field."
    )
    accelerator: Optional[str] = Field(
        None, description="GPU type to ask a cloud for (`overdrive skypilot`: e.g. A100, H100, L4)."
    )
    backend: Literal["auto", "nccl", "gloo", "mpi", "xccl", "hccl"] = Field(
        "auto", description="Process-group backend: `auto` is nccl on CUDA (with a gloo side for FSDP CPU offload and "
        "full state dicts), gloo on CPU."
    )
    timeout_minutes: int = Field(
        60, ge=1, description="How long a collective waits for the slowest rank before the job fails. Covers the "
        "work rank 0 does alone while the others wait: tokenizing the data, checksumming checkpoints. "
        "(torch's own default is 10 minutes on nccl.)"
    )
    threads_per_process: Optional[int] = Field(None, ge=1, description="torch intra-op threads per process. Empty: cores / local processes.")
    enable_cpu_affinity: bool = Field(False, description="Pin each process to the CPU cores near its GPU.")
    debug: bool = Field(False, description="Check collectives for mismatches (slow; for debugging hangs).")
    main_training_function: str = Field("main", description="Kept for Accelerate configs; not used by overdrive.")
    script_conflicts: Literal["warn", "error"] = Field(
        "warn", description="`overdrive launch`: when the script's own TrainingArguments/Accelerator call sets a value "
        "the config also sets, differently. `warn`: rank 0 names both and the config's value is used; `error`: the run stops."
    )
