"""One description of a job, for every cluster writer: SLURM (lines.py), Kubernetes (k8s.py),
SkyPilot (skypilot.py).

    job = describe(resolved, name="overdrive")
    job.machines, job.min_machines, job.processes_per_machine, job.gpus_per_machine
    job.resolved_text          # the resolved config the workers run (secrets masked)
    job.env                    # what every worker's environment holds, from the config alone
    job.secrets                # variables the cluster passes in from its own secret store
    job.worker(path)           # the command each rank runs, reading the resolved config at `path`

Secrets are referenced, never written: a writer names `job.secrets` (each an environment
variable and what it holds) and says where the cluster takes it from (the submitting shell
for SLURM, a Kubernetes Secret's key, SkyPilot's `--secret`); no value reaches a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from overdrive.resolving import SECRETS_VARIABLE
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.launch import membership
from overdrive.launch.job_checks import cluster_problems
from overdrive.launch.process import local_processes, process_env
from overdrive.launch.workers import train_worker
from overdrive.strategies.cpu import target_gpus

# Credentials a tracker reads from its environment, by the name in logging.trackers.
TRACKER_SECRETS = {"wandb": ("WANDB_API_KEY",), "comet_ml": ("COMET_API_KEY",), "mlflow": ("MLFLOW_TRACKING_TOKEN",),
                   "clearml": ("CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY")}
HUB_TOKEN = "HF_TOKEN"
# The cluster supplies the rendezvous address and each machine's rank.
CLUSTER_SUPPLIED = ("launch.main_process_ip", "launch.machine_rank")
CLUSTER_ADDRESS = "supplied-by-the-cluster"
# A container image reference as registries and kubelets parse it (the distribution reference
# grammar): [host[:port]/]path[:tag][@digest], path components lower-case.
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?/)"
IMAGE_REFERENCE = re.compile(rf"{_HOST}?{_PATH_PART}(?:/{_PATH_PART})*(?::[\w][\w.-]{{0,127}})?"
                             r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
ACCELERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class SecretVariable:
    name: str  # the environment variable a worker reads
    holds: str  # what it carries, for comments and messages (never the value)
    required: bool  # the run needs it (the config's own secrets); else used when present


@dataclass(frozen=True)
class Job:
    name: str
    config: RunConfig
    resolved_text: str
    env: dict[str, str] = field(default_factory=dict)
    secrets: tuple[SecretVariable, ...] = ()

    @property
    def machines(self) -> int:
        return self.config.launch.num_machines

    @property
    def min_machines(self) -> int:
        return self.config.launch.min_machines or self.machines

    @property
    def processes_per_machine(self) -> int:
        return local_processes(self.config)

    @property
    def gpus_per_machine(self) -> int:
        return target_gpus(self.config)

    @property
    def port(self) -> int:
        return self.config.launch.main_process_port

    @property
    def image(self) -> str | None:
        return self.config.launch.image

    def worker(self, resolved_path: str) -> list[str]:
        return ["python", "-m", *train_worker(resolved_path)[1:]]

    def torchrun(self, *rendezvous: str) -> list[str]:
        """`python -m torch.distributed.run` for one machine: its processes, then `rendezvous`
        (how this cluster tells a machine the others' address and its rank)."""
        # torch's agent restarts the workers itself here (no overdrive launcher around it): an
        # elastic job needs a restart per machine it may lose.
        return ["python", "-m", "torch.distributed.run", "--nproc-per-node", str(self.processes_per_machine),
                "--max-restarts", str(membership.regroups_allowed(self.config)), *rendezvous]


def secret_variables(resolved: Any) -> tuple[SecretVariable, ...]:
    """The variables a job's workers take from the cluster's secret store."""
    found = []
    keys = sorted(resolved.secret_values()) if hasattr(resolved, "secret_values") else []
    if keys:
        found.append(SecretVariable(SECRETS_VARIABLE, f"JSON of the config's secret values: {', '.join(keys)}", True))
    found.append(SecretVariable(HUB_TOKEN, "Hugging Face hub token (private or gated models and data)", False))
    for tracker in resolved.config.logging.trackers:
        for name in TRACKER_SECRETS.get(tracker, ()):
            found.append(SecretVariable(name, f"{tracker} credentials (logging.trackers)", False))
    return tuple(found)


def resolve_for_cluster(files: Sequence[str], cli: Sequence[str], accelerate_default: bool = True) -> Any:
    """The config for a job whose cluster supplies the rendezvous address (each machine learns
    it from the cluster): launch.main_process_ip is not asked for unless given."""
    from overdrive.resolving import resolve

    given = any(item.split("=", 1)[0] in ("launch.main_process_ip", "main_process_ip") for item in cli)
    supplied = [] if given else [f"launch.main_process_ip={CLUSTER_ADDRESS}"]
    return resolve(list(files), cli=[*supplied, *cli], accelerate_default=accelerate_default)


def describe(resolved: Any, name: str = "overdrive", container: bool = False) -> Job:
    """The job for `resolved` on machines of its own, checked: bad input is refused by key.
    `container`: it runs in a container (an image is needed, and the name names pods)."""
    cfg: RunConfig = resolved.config
    found = cluster_problems(cfg, CLUSTER_SUPPLIED)  # what train on the cluster's machines checks
    if container and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", name):
        found.append(Problem("--job-name", f"{name!r} is not a plain job name",
                             fix="use lower-case letters, digits and '-', starting and ending with a letter or digit "
                                 "(at most 42 characters: Kubernetes derives pod names from it)"))
    if container and not cfg.launch.image:
        found.append(Problem("launch.image", "is required: the job runs in a container",
                             fix="set launch.image to an image with overdrive and torch installed, "
                                 "e.g. launch.image=ghcr.io/you/overdrive:latest"))
    found += value_problems(cfg)
    if found:
        raise UserError(found, title="cannot write the job")
    env = process_env(cfg, elsewhere=True)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return Job(name, cfg, resolved.to_json(), env, secret_variables(resolved))


def value_problems(cfg: RunConfig) -> list[Problem]:
    """Values a cluster would refuse only once the job is submitted (an image it cannot pull by
    that name, an accelerator type with a count inside it), refused here by key."""
    found = []
    image = cfg.launch.image
    if image and not IMAGE_REFERENCE.fullmatch(image):
        found.append(Problem("launch.image", f"{image!r} is not an image reference",
                             fix="[registry/]path[:tag][@sha256:digest], the path in lower case with no spaces, "
                                 "e.g. ghcr.io/you/overdrive:1.0"))
    accelerator = cfg.launch.accelerator
    if accelerator is not None and not ACCELERATOR_NAME.fullmatch(accelerator):
        found.append(Problem("launch.accelerator", f"{accelerator!r} is not an accelerator type",
                             fix="name the type alone, e.g. launch.accelerator=A100; the count per machine comes "
                                 "from launch.gpus_per_machine"))
    return found


def comment_lines(job: Job, secret_source: str) -> list[str]:
    """What the job needs from the cluster, as comment text: the secrets by name only."""
    lines = [f"{job.machines} machine(s) x {job.processes_per_machine} process(es), strategy "
             f"{job.config.parallel.strategy}, {job.gpus_per_machine or 'no'} GPU(s) per machine."]
    if job.min_machines < job.machines:
        lines.append(f"Elastic: goes on with {job.min_machines} to {job.machines} machines (launch.min_machines).")
    if job.secrets:
        lines.append(f"Secrets, never written here: {secret_source}")
        lines += [f"  {s.name}{'' if s.required else ' (optional)'}: {s.holds}" for s in job.secrets]
    return lines


def to_yaml(documents: Sequence[Any], header: Sequence[str] = ()) -> str:
    """YAML documents headed by comment lines; text of several lines (a config, a script) as
    a literal block, readable as it will be read."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)
    Dumper.add_representer(str, text)
    body = yaml.dump_all(list(documents), Dumper=Dumper, sort_keys=False, width=120)
    return "".join(f"# {line}\n" for line in header) + body


def shell_join(args: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(str(a)) for a in args)
