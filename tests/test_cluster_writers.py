"""`overdrive k8s` (TrainJob, PyTorchJob, JobSet) and `overdrive skypilot`, checked against the
published schemas in tests/fixtures (see the READMEs there), and the elastic rules of
`launch.min_machines`. No process starts: the commands run in this interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from overdrive.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOKEN = "hf_PlantedHubTokenAbcdefghijklmn34"
JOB = ["launch.num_machines=4", "launch.num_processes=32", "launch.gpus_per_machine=8", "parallel.strategy=fsdp",
       "precision.mixed_precision=bf16", "launch.image=ghcr.io/example/overdrive:1",
       f"parallel.deepspeed.extra.hub_token={TOKEN}"]
CRDS = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml", "PyTorchJob": "kubeflow.org_pytorchjobs.yaml",
        "JobSet": "jobset.x-k8s.io_jobsets.yaml"}


@pytest.fixture(scope="module")
def schemas():
    """kind -> {apiVersion: openAPIV3Schema} of each published CRD."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    found = {}
    for kind, name in CRDS.items():
        crd = yaml.load((FIXTURES / "crds" / name).read_text(), Loader=loader)
        group = crd["spec"]["group"]
        found[kind] = {f"{group}/{v['name']}": v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]}
    return found


def written(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def documents(text: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def strict(schema):
    """The API server prunes fields its schema does not name; here an unknown field fails, so a
    misspelt one cannot pass unnoticed."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate(schemas, manifest: dict) -> None:
    schema = strict(schemas[manifest["kind"]][manifest["apiVersion"]])
    jsonschema.Draft7Validator(schema).validate(manifest)


def test_the_schemas_catch_a_misspelt_or_mistyped_field(schemas, capsys):
    job = documents(written(capsys, "k8s", *JOB)[1])["TrainJob"]
    validate(schemas, job)
    for field, value in (("numNodes", "four"), ("numNode", 4)):
        broken = json.loads(json.dumps(job))
        broken["spec"]["trainer"][field] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(schemas, broken)


def test_a_trainjob_for_4_machines_of_8_gpus_passes_the_crd_and_references_the_token(schemas, capsys):
    code, out, err = written(capsys, "k8s", *JOB)
    assert code == 0, err
    assert TOKEN not in out and TOKEN not in err
    manifests = documents(out)
    job = manifests["TrainJob"]
    validate(schemas, job)
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert trainer["image"] == "ghcr.io/example/overdrive:1"
    assert "-m overdrive.cli train --resolved /etc/overdrive/resolved.json" in " ".join(trainer["command"])
    secret = next(e for e in trainer["env"] if e["name"] == "OVERDRIVE_SECRET_VALUES")
    assert secret["valueFrom"]["secretKeyRef"] == {"name": "overdrive-secrets", "key": "OVERDRIVE_SECRET_VALUES",
                                                   "optional": False}
    assert "hub_token" in out.split("apiVersion")[0]  # the header names what the Secret must hold
    # The ConfigMap holds the resolved config the ranks run, its secret masked.
    resolved = json.loads(manifests["ConfigMap"]["data"]["resolved.json"])
    assert resolved["config"]["parallel"]["strategy"] == "fsdp"
    assert resolved["config"]["precision"]["mixed_precision"] == "bf16"
    assert resolved["config"]["parallel"]["deepspeed"]["extra"]["hub_token"] == "***"


# 1 x 3 x 32 = 96 samples: a whole accumulation on 2, 3 and 4 machines.
ELASTIC = ["launch.min_machines=2", "training.micro_batch_size=1", "training.gradient_accumulation_steps=3"]


@pytest.mark.parametrize("kind, extra", [("pytorchjob", []), ("pytorchjob", ELASTIC), ("jobset", [])])
def test_every_other_kind_passes_its_crd(schemas, capsys, kind, extra):
    code, out, err = written(capsys, "k8s", *JOB, *extra, "--kind", kind)
    assert code == 0, err
    assert TOKEN not in out
    manifest = next(doc for doc in yaml.safe_load_all(out) if doc["kind"] != "ConfigMap")
    validate(schemas, manifest)
    text = json.dumps(manifest)
    assert "overdrive.cli" in text and '"secretKeyRef"' in text
    if kind == "pytorchjob" and extra:
        policy = manifest["spec"]["elasticPolicy"]
        assert (policy["minReplicas"], policy["maxReplicas"]) == (2, 4)
        assert manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    elif kind == "pytorchjob":
        replicas = manifest["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 4
    else:
        assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 4


def test_a_skypilot_task_passes_its_schema_and_maps_the_node_rank_and_addresses(capsys):
    code, out, err = written(capsys, "skypilot", *JOB, "launch.accelerator=H100")
    assert code == 0, err
    assert TOKEN not in out
    task = yaml.safe_load(out)
    schema = json.loads((FIXTURES / "skypilot" / "task-schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(task)
    assert task["num_nodes"] == 4 and task["resources"]["accelerators"] == {"H100": 8}
    assert task["resources"]["image_id"] == "docker:ghcr.io/example/overdrive:1"
    assert task["secrets"]["OVERDRIVE_SECRET_VALUES"] is None  # a name: the value is given at launch
    assert '--node-rank "$SKYPILOT_NODE_RANK"' in task["run"] and "$SKYPILOT_NODE_IPS" in task["run"]
    assert "-m overdrive.cli train --resolved" in task["run"]
    assert any(mount.get("mode") == "MOUNT" for mount in task["file_mounts"].values())


@pytest.mark.parametrize("argv, key", [
    (["k8s", *JOB[:-2]], "launch.image"),  # no image
    (["k8s", *JOB, "launch.min_machines=5"], "launch.min_machines"),  # a min above the max
    (["k8s", *JOB, "launch.min_machines=3"], "launch.min_machines"),  # 3 x 8 processes cannot keep 32 x 8
    (["skypilot", *JOB], "launch.accelerator"),  # GPUs of no named type
    (["k8s", *JOB, "launch.image=ghcr.io/Example/overdrive:1"], "launch.image"),  # registries take lower case
    (["k8s", *JOB, "launch.image=my image"], "launch.image"),
    (["skypilot", *JOB, "launch.accelerator=A100:8"], "launch.accelerator"),
    (["k8s", *JOB, "output_dir=/etc"], "output_dir"),  # the volume would hide the config's own mount
    (["k8s", *JOB, "output_dir=../.."], "output_dir"),  # the container's root  # the count is gpus_per_machine
    (["skypilot", *JOB, "launch.accelerator=H100", "output_dir=/"], "output_dir"),  # the bucket over the node's root
    (["skypilot", *JOB, "launch.accelerator=H100", "--job-name", "Bad name"], "--job-name"),
    # what train refuses on the cluster's machines, each writer refuses (slurm did, k8s and skypilot did not)
    (["k8s", *JOB, "parallel.tp_size=8", "model.architecture.n_head=12"], "parallel.tp_size"),
    (["skypilot", *JOB, "launch.accelerator=H100", "parallel.tp_size=8", "model.architecture.n_head=12"],
     "parallel.tp_size"),
    (["explain", "launch.num_machines=2", "launch.num_processes=2", "launch.main_process_ip=10.0.0.1",
      "launch.min_machines=3"], "launch.min_machines"),
])
def test_bad_input_is_refused_by_key(capsys, argv, key):
    code, out, err = written(capsys, *argv)
    assert code == 2, (out, err)
    assert f"- {key}:" in err
    assert "Traceback" not in err


def test_an_image_with_a_tag_and_a_digest_is_written_as_given(capsys):
    image = "ghcr.io/example/overdrive:1.0@sha256:" + "a" * 64
    code, out, err = written(capsys, "k8s", *JOB, f"launch.image={image}")
    assert code == 0, err
    assert documents(out)["TrainJob"]["spec"]["trainer"]["image"] == image


def test_an_output_dir_with_dots_is_mounted_where_the_worker_writes(capsys):
    code, out, err = written(capsys, "k8s", *JOB, "--kind", "jobset", "output_dir=runs/../out")
    assert code == 0, err
    mounts = documents(out)["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "output", "mountPath": "/workspace/out"} in mounts["containers"][0]["volumeMounts"]


def test_a_shrink_that_cannot_keep_the_global_batch_lists_the_machine_counts_that_can(capsys):
    code, _, err = written(capsys, "k8s", *JOB, "launch.min_machines=1")
    assert code == 2
    # global batch 8 x 1 x 32 = 256 over 8 processes per machine: 3 machines (24) cannot.
    assert "3 cannot keep the global batch of 256" in err and "machine counts that keep it: 1, 2, 4" in err


EARLIER_TRAINERS = {"2.0": "trainer.kubeflow.org_trainjobs-v2.0.1.yaml", "2.1": "trainer.kubeflow.org_trainjobs-v2.1.0.yaml"}


@pytest.mark.parametrize("version", sorted(EARLIER_TRAINERS))
def test_a_trainjob_for_an_earlier_trainer_release_passes_that_release_s_crd(version, schemas, capsys):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((FIXTURES / "crds" / EARLIER_TRAINERS[version]).read_text(), Loader=loader)
    earlier = {"TrainJob": {f"{crd['spec']['group']}/{v['name']}": v["schema"]["openAPIV3Schema"]
                            for v in crd["spec"]["versions"]}}
    code, out, err = written(capsys, "k8s", *JOB, f"launch.kubeflow_trainer_version={version}")
    assert code == 0, err
    job = documents(out)["TrainJob"]
    validate(earlier, job)
    assert "runtimePatches" not in job["spec"]
    text = json.dumps(job)
    assert '"medium": "Memory"' in text and '"mountPath": "/dev/shm"' in text  # the volumes still reach the pods
    # The default (2.3) TrainJob is what that release's CRD rejects.
    with pytest.raises(jsonschema.ValidationError, match="runtimePatches"):
        validate(earlier, documents(written(capsys, "k8s", *JOB)[1])["TrainJob"])


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob", "jobset"])
def test_every_pod_gets_a_memory_backed_dev_shm(kind, capsys):
    code, out, err = written(capsys, "k8s", *JOB, "--kind", kind)
    assert code == 0, err
    job = next(doc for doc in yaml.safe_load_all(out) if doc["kind"] != "ConfigMap")
    pods = []

    def find(node):
        if isinstance(node, dict):
            if "volumes" in node and "containers" in node:
                pods.append(node)
            for value in node.values():
                find(value)
        elif isinstance(node, list):
            for value in node:
                find(value)

    find(job)
    assert pods
    for pod in pods:
        shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1
        assert {"name": shm[0], "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
