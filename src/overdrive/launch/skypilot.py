"""The run as a SkyPilot task (`overdrive skypilot`): num_nodes and accelerators from the
config, output_dir on a bucket every node mounts, and a `run:` that hands SkyPilot's node rank
and node addresses to torch.distributed.run (SKYPILOT_NODE_RANK -> the machine rank, the first
of SKYPILOT_NODE_IPS -> the rendezvous address). The resolved config travels in the task
(written by `setup:`), its secrets as SkyPilot secrets: named here, their values given at
launch (`sky launch task.yaml --secret HF_TOKEN`, read from the launching shell), never
written. Checked against SkyPilot's own task schema (tests/fixtures/skypilot).
"""

from __future__ import annotations

from overdrive.console import counted

from pathlib import PurePosixPath
from typing import Any

from overdrive.errors import Problem
from overdrive.launch.job import Job, comment_lines, shell_join, to_yaml

HOME = "~/overdrive"  # file_mounts: SkyPilot expands ~ on each node
RESOLVED = "$HOME/overdrive/resolved.json"  # in the shell of setup: and run:


def _output_mount(job: Job) -> str:
    out = PurePosixPath(str(job.config.output_dir))
    return str(out if out.is_absolute() else PurePosixPath(HOME) / out)


def _rendezvous(job: Job) -> list[str]:
    if job.min_machines < job.machines:
        return ["--nnodes", f"{job.min_machines}:{job.machines}", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"$MASTER_ADDR:{job.port}", "--rdzv-id", "$SKYPILOT_TASK_ID"]
    return ["--nnodes", "$SKYPILOT_NUM_NODES", "--node-rank", "$SKYPILOT_NODE_RANK", "--master-addr", "$MASTER_ADDR",
            "--master-port", str(job.port)]


def _shell_word(arg: str) -> str:
    """One word of the run: line. The node's own variables ($SKYPILOT_NODE_RANK, ...) expand."""
    return f'"{arg}"' if "$" in arg else shell_join([arg])


# Directories a bucket mounted over would hide what the node runs on.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/opt", "/proc", "/root", "/run",
               "/sbin", "/sys", "/tmp", "/usr", "/var")
# The task's name also names its bucket (`NAME-output`): a bucket name is 3-63 lower-case
# letters, digits and '-' (S3, GCS, Azure), starting and ending with a letter or digit.
NAME = r"[a-z0-9]([-a-z0-9]{0,54}[a-z0-9])?"


def problems(job: Job) -> list[Problem]:
    import re

    found = []
    if not re.fullmatch(NAME, job.name):
        found.append(Problem("--job-name", f"{job.name!r} is not a plain task name (it also names the bucket "
                             f"{job.name}-output)", fix="use lower-case letters, digits and '-', starting and ending "
                             "with a letter or digit (at most 56 characters)"))
    mount = _output_mount(job)
    if str(PurePosixPath(mount)) in SYSTEM_DIRS:
        found.append(Problem("output_dir", f"{job.config.output_dir} mounts the output bucket at {mount}, over the "
                             "node's own " + ("root" if mount == "/" else "system directory"),
                             fix="use a directory of its own, e.g. output_dir=/data/run or a relative path "
                                 f"(under {HOME})"))
    if job.gpus_per_machine and not job.config.launch.accelerator:
        found.append(Problem("launch.accelerator", f"is needed to ask a cloud for {counted(job.gpus_per_machine, 'GPU')} per "
                             "machine", fix="name the GPU type, e.g. launch.accelerator=A100 (or launch.use_cpu=true "
                             "for CPU machines)"))
    return found


def task(job: Job) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if job.gpus_per_machine:
        resources["accelerators"] = {job.config.launch.accelerator: job.gpus_per_machine}
    if job.image:
        resources["image_id"] = f"docker:{job.image}"
    command = " ".join(_shell_word(arg) for arg in [*job.torchrun(*_rendezvous(job)), *job.worker(RESOLVED)[1:]])
    run = "\n".join(['mkdir -p "$HOME/overdrive" && cd "$HOME/overdrive"',
                     'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)', command, ""])
    setup = f'mkdir -p "$HOME/overdrive"\ncat > "{RESOLVED}" <<\'OVERDRIVE_RESOLVED\'\n{job.resolved_text}\nOVERDRIVE_RESOLVED\n'
    spec: dict[str, Any] = {"name": job.name, "num_nodes": job.machines}
    if resources:
        spec["resources"] = resources
    spec["envs"] = dict(sorted(job.env.items()))
    if job.secrets:
        spec["secrets"] = {s.name: None for s in job.secrets}
    spec["file_mounts"] = {_output_mount(job): {"name": f"{job.name}-output", "mode": "MOUNT"}}
    spec["setup"] = setup
    spec["run"] = run
    return spec


def render(job: Job) -> str:
    source = "SkyPilot secrets, given at launch: sky launch TASK.yaml " + " ".join(f"--secret {s.name}" for s in job.secrets)
    header = ["Written by `overdrive skypilot`.", *comment_lines(job, source),
              f"output_dir: the bucket {job.name}-output, mounted at {_output_mount(job)} on every node."]
    return to_yaml([task(job)], header)
