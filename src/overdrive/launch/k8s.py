"""The run as Kubernetes manifests (`overdrive k8s`): a Kubeflow Trainer TrainJob (the
default), a Kubeflow PyTorchJob, or a JobSet, each with a ConfigMap holding the resolved config.

Every kind runs the same container: `python -m torch.distributed.run` on each machine (the
kind's controller supplies the machine's rank and the rendezvous address through torchrun's
PET_* variables; for a JobSet they are set here), each rank running `overdrive train
--resolved` on the ConfigMap's file. output_dir lives on a PersistentVolumeClaim
(`<name>-output`, mounted where output_dir points), the secrets come from a Secret
(`<name>-secrets`, one key per variable) by `secretKeyRef`: never written. Elastic min/max goes
where the kind has it (PyTorchJob's elasticPolicy); TrainJob and JobSet run every machine.

Checked against the published CRD schemas in tests/fixtures/crds.
"""

from __future__ import annotations

import posixpath
from pathlib import PurePosixPath
from typing import Any

from overdrive.errors import Problem

from overdrive.launch import membership
from overdrive.launch.job import Job, comment_lines, shell_join, to_yaml

KINDS = ("trainjob", "pytorchjob", "jobset")
CONFIG_DIR = "/etc/overdrive"
WORKDIR = "/workspace"
CONTAINER = "node"  # the name Kubeflow Trainer's torch runtime gives its trainer container and job


def secret_name(job: Job) -> str:
    return f"{job.name}-secrets"


def _env(job: Job) -> list[dict[str, Any]]:
    plain = [{"name": k, "value": v} for k, v in sorted(job.env.items())]
    refs = [{"name": s.name, "valueFrom": {"secretKeyRef": {"name": secret_name(job), "key": s.name,
                                                            "optional": not s.required}}} for s in job.secrets]
    return plain + refs


def _output_mount(job: Job) -> str:
    out = PurePosixPath(str(job.config.output_dir))
    # Kubernetes takes the path as written: `..` is resolved here, as the worker's cwd resolves it.
    return posixpath.normpath(str(out if out.is_absolute() else PurePosixPath(WORKDIR) / out))


# The image's own directories: a volume mounted over one (or over a folder that holds one) hides what
# the container runs (Python, its libraries, the shell), and the job dies before it starts.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/root", "/run",
               "/sbin", "/sys", "/usr", "/var")


def problems(job: Job) -> list[Problem]:
    """An output_dir the volume claim cannot be mounted at: the root, the config's own mount, the
    image's system directories, or the working directory itself."""
    mount = _output_mount(job)
    inside = lambda a, b: a == b or a.startswith(b.rstrip("/") + "/")  # noqa: E731
    system = next((d for d in SYSTEM_DIRS if inside(mount, d)), None)
    if mount == "/" or inside(mount, CONFIG_DIR) or inside(CONFIG_DIR, mount) or system or mount == WORKDIR:
        why = ("is the container's root" if mount == "/" else f"is the image's {system}" if system
               else f"is the working directory {WORKDIR}" if mount == WORKDIR
               else f"overlaps the config's mount {CONFIG_DIR}")
        return [Problem("output_dir", f"{job.config.output_dir} is mounted at {mount}, which {why}: the volume "
                        "would hide what is there", fix=f"use a directory of its own, e.g. output_dir=/data/run or "
                        f"a relative path under {WORKDIR} (runs/my-run)")]
    return []


def _volumes(job: Job) -> list[dict[str, Any]]:
    # A container's /dev/shm is 64 MiB unless a volume says otherwise: NCCL's shared-memory
    # transport between the GPUs of one machine and DataLoader workers need far more.
    return [{"name": "config", "configMap": {"name": f"{job.name}-config"}},
            {"name": "output", "persistentVolumeClaim": {"claimName": f"{job.name}-output"}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}}]


def _mounts(job: Job) -> list[dict[str, Any]]:
    return [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "output", "mountPath": _output_mount(job)},
            {"name": "shm", "mountPath": "/dev/shm"}]


def _resources(job: Job) -> dict[str, Any]:
    return {"limits": {"nvidia.com/gpu": job.gpus_per_machine}} if job.gpus_per_machine else {}


def _command(job: Job, *rendezvous: str) -> list[str]:
    return [*job.torchrun(*rendezvous), *job.worker(f"{CONFIG_DIR}/resolved.json")[1:]]


def _container(job: Job, *rendezvous: str, extra_env: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    container = {"name": CONTAINER, "image": job.image, "workingDir": WORKDIR, "command": _command(job, *rendezvous),
                 "env": [*extra_env, *_env(job)], "volumeMounts": _mounts(job)}
    if job.gpus_per_machine:
        container["resources"] = _resources(job)
    return container


def _pod(job: Job, container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"spec": {"containers": [container], "volumes": _volumes(job), **spec}}


def config_map(job: Job) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{job.name}-config"},
            "data": {"resolved.json": job.resolved_text}}


def trainjob(job: Job) -> dict[str, Any]:
    """Kubeflow Trainer (trainer.kubeflow.org/v1alpha1) on its torch-distributed runtime: the
    runtime supplies PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT; the volumes reach the
    runtime's `node` job through a runtime patch."""
    # The runtime's container takes no working directory: the command moves to it.
    command = ["sh", "-c", f"mkdir -p {WORKDIR} && cd {WORKDIR} && exec {shell_join(_command(job))}"]
    trainer = {"image": job.image, "command": command, "env": _env(job), "numNodes": job.machines,
               "numProcPerNode": job.processes_per_machine}
    if job.gpus_per_machine:
        trainer["resourcesPerNode"] = _resources(job)
    pod = {"volumes": _volumes(job), "containers": [{"name": CONTAINER, "volumeMounts": _mounts(job)}]}
    spec = {"runtimeRef": {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"}, "trainer": trainer}
    spec.update(_pod_patch(job.config.launch.kubeflow_trainer_version, pod))
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": job.name},
            "spec": spec}


def _pod_patch(version: str, pod: dict[str, Any]) -> dict[str, Any]:
    """How the volumes reach the runtime's `node` pods, by Trainer release (each CRD knows one):
    2.0 `podSpecOverrides`, 2.1 `podTemplateOverrides`, 2.2 on `runtimePatches`."""
    target = [{"name": CONTAINER}]
    if version == "2.0":
        return {"podSpecOverrides": [{"targetJobs": target, **pod}]}
    if version == "2.1":
        return {"podTemplateOverrides": [{"targetJobs": target, "spec": pod}]}
    return {"runtimePatches": [{"manager": "overdrive", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": CONTAINER, "template": {"spec": {"template": {"spec": pod}}}}]}}}}]}


def pytorchjob(job: Job) -> dict[str, Any]:
    """Kubeflow Training Operator v1 (kubeflow.org/v1): a Master and Workers, or, elastic,
    Workers only with an elasticPolicy (the operator then sets the c10d rendezvous)."""
    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": _pod(job, _container(job))}
    spec: dict[str, Any] = {"runPolicy": {"cleanPodPolicy": "Running"}, "nprocPerNode": str(job.processes_per_machine)}
    if job.min_machines < job.machines:
        spec["elasticPolicy"] = {"minReplicas": job.min_machines, "maxReplicas": job.machines, "rdzvBackend": "c10d",
                                 "maxRestarts": membership.regroups_allowed(job.config)}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(job.machines)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1), **({"Worker": replica(job.machines - 1)}
                                                                if job.machines > 1 else {})}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": job.name}, "spec": spec}


def jobset(job: Job) -> dict[str, Any]:
    """JobSet (jobset.x-k8s.io/v1alpha2): one Indexed Job of `machines` pods; a pod's index is
    its machine rank, pod 0 (reachable by its DNS name) hosts the rendezvous."""
    master = f"{job.name}-{CONTAINER}-0-0.{job.name}"
    rank = {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    env = (rank, {"name": "PET_NNODES", "value": str(job.machines)}, {"name": "PET_MASTER_ADDR", "value": master},
           {"name": "PET_MASTER_PORT", "value": str(job.port)})
    pod = _pod(job, _container(job, extra_env=env), restartPolicy="Never", subdomain=job.name)
    template = {"spec": {"parallelism": job.machines, "completions": job.machines, "completionMode": "Indexed",
                         "backoffLimit": 0, "template": pod}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": job.name},
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": job.name},
                     "failurePolicy": {"maxRestarts": job.config.launch.max_restarts},
                     "replicatedJobs": [{"name": CONTAINER, "replicas": 1, "template": template}]}}


WRITERS = {"trainjob": trainjob, "pytorchjob": pytorchjob, "jobset": jobset}


def manifests(job: Job, kind: str = "trainjob") -> list[dict[str, Any]]:
    return [config_map(job), WRITERS[kind](job)]


def render(job: Job, kind: str = "trainjob") -> str:
    """The manifests as one YAML stream, headed by what the cluster must provide."""
    source = (f"a Secret named {secret_name(job)}, one key per variable "
              f"(kubectl create secret generic {secret_name(job)} --from-literal=NAME=...)")
    header = [f"Written by `overdrive k8s --kind {kind}`.", *comment_lines(job, source),
              f"output_dir: the PersistentVolumeClaim {job.name}-output, mounted at {_output_mount(job)}."]
    if kind != "pytorchjob" and job.min_machines < job.machines:
        header.append(f"A {kind} has no elastic size: every machine runs (launch.min_machines is used by "
                      "`--kind pytorchjob` and by `overdrive train`).")
    return to_yaml(manifests(job, kind), header)
