"""Launching: the torchrun arguments, the worker environment, refusing before anything
starts, the equivalent command lines and the SLURM script."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import cfg_of
from conftest import REPO, run_cli

from overdrive.launch import process, workers
from overdrive.resolving import Resolved, resolve
from overdrive.config.schema import LaunchConfig, RunConfig
from overdrive.errors import UserError


# --------------------------------------------------------------------------- torchrun arguments


def test_single_machine_static_rendezvous():
    args = workers.torchrun_args(cfg_of("launch.num_processes=4", "launch.main_process_port=29555", "launch.max_restarts=2"))
    assert args == ["--nnodes", "1", "--nproc-per-node", "4", "--max-restarts", "2", "--monitor-interval", "0.1",
                    "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29555"]


def test_multi_node_splits_processes_over_machines():
    cfg = cfg_of("launch.num_processes=16", "launch.num_machines=2", "launch.machine_rank=1",
                 "launch.main_process_ip=10.0.0.1")
    args = workers.torchrun_args(cfg)
    assert args[args.index("--nnodes") + 1] == "2"
    assert args[args.index("--nproc-per-node") + 1] == "8"
    assert args[args.index("--node-rank") + 1] == "1"
    assert args[args.index("--master-addr") + 1] == "10.0.0.1"


def test_c10d_rendezvous_needs_no_node_rank():
    cfg = cfg_of("launch.num_processes=4", "launch.num_machines=2", "launch.main_process_ip=10.0.0.1",
                 "launch.rdzv_backend=c10d", "launch.rdzv_id=job7")
    args = workers.torchrun_args(cfg)
    assert "--node-rank" not in args
    assert args[args.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert args[args.index("--rdzv-id") + 1] == "job7"


def test_the_printed_torchrun_line_of_an_elastic_job_regroups_by_itself(tmp_path, capsys):
    """No overdrive launcher stands behind a torchrun the user starts by hand: the printed line
    itself takes min:max machines and a restart per machine the job may lose."""
    from torch.distributed.run import get_args_parser

    from overdrive.launch import lines

    resolved = resolve([REPO / "configs" / "multi-node.yaml"], cli=["launch.min_machines=1", f"output_dir={tmp_path}"],
                       env={}, accelerate_default=False)
    torchrun = lines.launch_lines(resolved)["torchrun"]
    parsed = get_args_parser().parse_args(torchrun.split(" torchrun ", 1)[1].split())
    assert parsed.nnodes == "1:2" and parsed.max_restarts == 1 and parsed.rdzv_backend == "c10d"
    assert "last_call_timeout" not in torchrun  # machines started by hand get torch's own wait for latecomers
    assert lines.print_launch(resolved) == 0
    assert "launch.min_machines=1 does not apply to this line" in capsys.readouterr().out
    fixed = resolve([REPO / "configs" / "multi-node.yaml"], cli=[f"output_dir={tmp_path}"], env={},
                    accelerate_default=False)
    assert "--nnodes 2 " in lines.launch_lines(fixed)["torchrun"]


def test_a_busy_port_the_user_chose_is_refused_by_its_key_and_one_nobody_chose_is_the_stores_own():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        chosen = resolve([], cli=["launch.num_processes=2", f"launch.main_process_port={port}"], env={},
                         accelerate_default=False)
        assert workers.port_chosen(chosen)
        with pytest.raises(UserError) as error:
            workers.refuse_busy_port(chosen.config, True)
        assert [p.key for p in error.value.problems] == ["launch.main_process_port"]
        assert str(port) in error.value.render()
        # Several machines agreed on the port: it is kept (and the rendezvous says a clash by its key).
        multi = cfg_of("launch.num_processes=2", "launch.num_machines=2", "launch.main_process_ip=127.0.0.1",
                       f"launch.main_process_port={port}")
        workers.refuse_busy_port(multi, True)
        assert not workers.own_port(multi, False)
    default = resolve([], cli=["launch.num_processes=2"], env={}, accelerate_default=False)
    assert not workers.port_chosen(default) and workers.own_port(default.config, False)
    args = workers.torchrun_args(default.config, own=True)
    assert args[args.index("--rdzv-endpoint") + 1] == "127.0.0.1:0" and args[args.index("--rdzv-backend") + 1] == "c10d"
    other = workers.torchrun_args(default.config, own=True)
    assert args[args.index("--rdzv-id") + 1] != other[other.index("--rdzv-id") + 1]


def test_a_port_still_bound_by_a_stopped_job_is_busy_though_nothing_accepts_there():
    """A socket bound and not listening (what a stopped job can leave) refuses connections, yet
    the rendezvous store cannot bind it: the check binds, as the store would."""
    import socket

    with socket.socket() as left:
        left.bind(("0.0.0.0", 0))
        port = left.getsockname()[1]
        assert workers.port_in_use(port)
        with pytest.raises(UserError):
            workers.refuse_busy_port(cfg_of("launch.num_processes=2", f"launch.main_process_port={port}"), True)
    assert not workers.port_in_use(port)


@pytest.mark.slow
def test_a_rendezvous_whose_port_is_taken_says_the_port_and_key_not_a_traceback():
    import socket
    import sys

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        agent = subprocess.run([sys.executable, "-m", "overdrive.launch.elastic", "--nnodes", "1", "--nproc-per-node",
                                "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "json.tool",
                                "/dev/null"], capture_output=True, text=True, timeout=120)
    assert agent.returncode == 2, agent.stderr[-2000:]
    assert f"port {port}" in agent.stderr and "launch.main_process_port" in agent.stderr
    assert "Traceback" not in agent.stderr and "DistNetworkError" not in agent.stderr


# --------------------------------------------------------------------------- worker environment


def test_worker_environment(monkeypatch):
    base = {"PATH": "/bin", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "ACCELERATE_MIXED_PRECISION": "fp16"}
    env = process.worker_environment(cfg_of("parallel.strategy=deepspeed", "launch.num_processes=2",
                                           "launch.threads_per_process=3", "launch.use_cpu=true"), base)
    # Accelerate's own variables are already folded into the resolved config: not passed on.
    assert not [k for k in env if k.startswith(("ACCELERATE_", "FSDP_"))]
    assert env["OMP_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    assert env["DS_ACCELERATOR"] == "cpu"  # before deepspeed is imported in the worker
    monkeypatch.setattr(process.os, "cpu_count", lambda: 8)
    assert process.worker_environment(cfg_of("launch.num_processes=4"), {})["OMP_NUM_THREADS"] == "2"


# --------------------------------------------------------------------------- refusing before start


def test_launch_refuses_before_any_worker_starts(tmp_path, monkeypatch):
    """Even for a config that skipped validation: the keys are named, nothing is started or written."""
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    cfg = RunConfig(launch=LaunchConfig(num_processes=3, num_machines=2), output_dir=str(tmp_path / "run"))
    with pytest.raises(UserError) as raised:
        workers.launch_workers(Resolved(config=cfg, origins={}))
    text = str(raised.value)
    assert "launch.num_processes" in text and "launch.main_process_ip" in text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("items, key", [
    (["launch.num_processes=3", "launch.num_machines=2", "launch.main_process_ip=127.0.0.1"], "launch.num_processes"),
    (["launch.num_processes=2", "launch.num_machines=2"], "launch.main_process_ip"),
    (["launch.num_processes=2", "launch.num_machines=2", "launch.main_process_ip=127.0.0.1", "launch.machine_rank=2"],
     "launch.machine_rank"),
    (["parallel.strategy=deepspeed", "launch.num_processes=2", "training.micro_batch_size=4",
      "parallel.deepspeed.train_batch_size=16"], "parallel.deepspeed.train_batch_size"),
])
@pytest.mark.slow
def test_train_fails_fast_naming_the_key(items, key, tmp_path):
    done = run_cli("train", *items, f"output_dir={tmp_path / 'run'}", timeout=60)
    assert done.returncode == 2, done.stderr
    assert key in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "resolved.json").exists()  # no worker was started


@pytest.mark.slow
def test_user_script_launch_refuses_too(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('must not run')\n")
    done = run_cli("launch", "-s", "launch.num_machines=2", "-s", "launch.num_processes=2", str(script), timeout=60)
    assert done.returncode == 2 and "launch.main_process_ip" in done.stderr


# --------------------------------------------------------------------------- equivalent command lines


@pytest.mark.slow
def test_print_launch_lines_are_accepted_by_their_launchers(tmp_path):
    done = run_cli("train", str(REPO / "configs" / "zero3.yaml"), f"output_dir={tmp_path}", "--print-launch", timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "torchrun --nnodes 1 --nproc-per-node 2" in out
    assert "-m overdrive.cli train --resolved" in out
    assert "srun --nodes=1" in out
    assert not (tmp_path / "resolved.json").exists()  # printing starts nothing

    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser

    from overdrive.interop import writing as export
    cfg = resolve([REPO / "configs" / "zero3.yaml"], env={}, accelerate_default=False).config
    worker = workers.train_worker(tmp_path / "resolved.json")
    args = launch_command_parser().parse_args([*export.accelerate_flags(cfg), *worker])
    assert args.use_deepspeed and args.zero_stage == 3 and args.num_processes == 2
    assert args.mixed_precision == "bf16" and args.module and args.training_script == "overdrive.cli"
    torchrun = get_args_parser().parse_args([*workers.torchrun_args(cfg), *worker])
    assert torchrun.nproc_per_node == "2" and torchrun.module


@pytest.mark.slow
def test_slurm_script(tmp_path):
    job = tmp_path / "job.sbatch"
    done = run_cli("slurm", str(REPO / "configs" / "multi-node.yaml"), f"output_dir={tmp_path / 'run'}",
                   "-o", str(job), timeout=60)
    assert done.returncode == 0, done.stderr
    text = job.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert "--nproc-per-node 8" in text and "--rdzv-backend c10d" in text
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    # The job carries the resolved config itself.
    embedded = text.split("<<'OVERDRIVE_RESOLVED'\n", 1)[1].split("\nOVERDRIVE_RESOLVED", 1)[0]
    cfg = Resolved.from_json(embedded).config
    assert cfg.launch.num_processes == 16 and cfg.parallel.deepspeed.zero_stage == 2
    assert json.loads(embedded)["origins"]["launch.num_machines"].startswith("file")


def test_a_worker_that_failed_in_the_rendezvous_is_one_line_naming_the_port_and_key(tmp_path):
    import argparse

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from overdrive.launch.elastic import worker_rendezvous_failure

    def failed(message: str) -> ChildFailedError:
        path = tmp_path / f"error{abs(hash(message))}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                                        "timestamp": "1"}}}))
        return ChildFailedError("overdrive.cli", {0: ProcessFailure(0, 100, 1, str(path))})

    args = argparse.Namespace(rdzv_endpoint="", master_port=29511)
    said = worker_rendezvous_failure(failed("DistNetworkError: The server socket has failed to listen on any local "
                                            "network address. port: 29511, code: -98, name: EADDRINUSE"), args)
    assert said is not None and "port 29511" in said and "launch.main_process_port" in said
    # A peer that died in a collective is that peer's story, not the rendezvous'.
    assert worker_rendezvous_failure(failed("DistNetworkError: Connection closed by peer [127.0.0.1]:4242"), args) is None
