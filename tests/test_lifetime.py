"""A job's processes live and die together (launch/lifetime.py): SIGKILL of a launcher's
process group leaves none of its workers, for `overdrive train` (which stops after the step
with a complete checkpoint, then resumes from it) and for a user's script under
`overdrive launch`, on one machine and on machine 1 of two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoint_probe import command, finish, kill_group, run, start, steps_logged, wait_for, warm_cache, worker_pids
from conftest import free_port

pytestmark = pytest.mark.slow  # every test here starts processes; the endings it times take ~0.1 s against 10
# allowed, also with another test beside it (measured), so it shares the machine

REPO = Path(__file__).resolve().parents[1]
RUN = ["training.micro_batch_size=4", "training.eval_every_steps=null", "checkpoint.every_steps=5",
       "data.max_bytes=60000", "training.max_steps=40"]
GONE_WITHIN = 10.0


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its new parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def seconds_until_gone(pids, killed_at: float) -> float:
    while any(alive(pid) for pid in pids) and time.monotonic() - killed_at < 30:
        time.sleep(0.02)
    return time.monotonic() - killed_at


def script_workers(out: Path) -> list[int]:
    """pids of the `overdrive launch --worker` processes running for `out`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        worker = b"--worker" in cmdline and b"overdrive.launch.elastic" not in cmdline  # not the agent
        if worker and str(out).encode() in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return warm_cache(tmp_path_factory.mktemp("lifetime-cache"), RUN + ["launch.threads_per_process=1"])


def test_killing_the_launchers_group_ends_a_users_script(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    script = REPO / "tests" / "resumable_script_probe.py"
    args = [sys.executable, "-m", "overdrive.cli", "launch", "-s", "launch.num_processes=2", "-s",
            f"launch.main_process_port={free_port()}", "-s", f"output_dir={out}", str(script), str(out), "400"]
    steps = out / "steps.jsonl"

    def logged() -> list[int]:
        return [json.loads(line)["step"] for line in steps.read_text().splitlines()] if steps.exists() else []
    proc = start(args, cwd=tmp_path)
    wait_for(lambda: len(logged()) >= 7, proc, what="step 7")
    pids = script_workers(out)
    assert len(pids) == 2, pids
    killed_at = time.monotonic()
    kill_group(proc)
    seconds = seconds_until_gone(pids, killed_at)
    print(f"overdrive launch: last worker gone {seconds:.2f} s after the launcher's group was killed")
    assert seconds < GONE_WITHIN, [pid for pid in pids if alive(pid)]
    finish(proc)
    newest = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*"))

    again = run([*args[:-1], str(newest + 2)], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {newest}" in again.stdout, again.stdout[-2000:]
    assert logged()[-2:] == [newest + 1, newest + 2]


def test_killing_the_launchers_group_ends_its_workers_after_a_complete_checkpoint_then_the_run_resumes(cache, tmp_path):
    out = tmp_path / "run"
    args = command(out, cache, *RUN, "launch.num_processes=2", "launch.threads_per_process=1")
    proc = start([*args, f"launch.main_process_port={free_port()}"], cwd=tmp_path)
    wait_for(lambda: len(steps_logged(out)) >= 7, proc, what="step 7")
    pids = worker_pids(out)
    assert set(pids) == {0, 1}, pids
    killed_at = time.monotonic()
    kill_group(proc)  # launcher and agent; the workers run in sessions of their own
    seconds = seconds_until_gone(pids.values(), killed_at)
    print(f"overdrive train: last worker gone {seconds:.2f} s after the launcher's group was killed")
    assert seconds < GONE_WITHIN, [pid for pid in pids.values() if alive(pid)]
    finish(proc)
    # Both stopped after the same step and saved it completely.
    stopped = max(steps_logged(out))
    saved = out / "checkpoints" / f"step-{stopped:08d}"
    assert (saved / "manifest.json").is_file(), sorted(p.name for p in (out / "checkpoints").iterdir())
    assert (saved / "random_states_0.pkl").is_file() and (saved / "random_states_1.pkl").is_file()

    again = run([*args, f"launch.main_process_port={free_port()}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and saved.name in again.stdout, again.stdout[-2000:]
    assert steps_logged(out) == list(range(1, 41))


def test_killing_machine_1s_launcher_leaves_none_of_its_workers(cache, tmp_path):
    """Two launchers on 127.0.0.1 as two machines; machine 1's whole group is killed."""
    out = tmp_path / "run"
    shared = [*RUN, "launch.num_processes=2", "launch.num_machines=2", "launch.main_process_ip=127.0.0.1",
              f"launch.main_process_port={free_port()}", "launch.threads_per_process=1"]
    machines = [start(command(out, cache, *shared, f"launch.machine_rank={rank}"), cwd=tmp_path) for rank in (0, 1)]
    wait_for(lambda: len(steps_logged(out)) >= 7, machines[1], what="step 7")
    pids = worker_pids(out)
    assert set(pids) == {0, 1}, pids
    killed_at = time.monotonic()
    kill_group(machines[1])
    seconds = seconds_until_gone([pids[1]], killed_at)
    print(f"two machines: machine 1's worker gone {seconds:.2f} s after its launcher's group was killed")
    assert seconds < GONE_WITHIN
    finish(machines[1])
    # Machine 0 does not go on alone or hang: the stop is agreed, so its rank stopped after the
    # same step, and both saved it.
    code, _, stderr = finish(machines[0], timeout=120)
    assert code != 0 and "stopped on SIGTERM" in stderr, stderr[-3000:]
    assert not worker_pids(out)
    stopped = max(steps_logged(out))
    assert (out / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").is_file()


def test_a_worker_whose_launcher_died_before_it_started_ends_at_once(tmp_path):
    """The race: the parent is gone before the parent-death signal was requested."""
    code = "from overdrive.launch import lifetime; import time; lifetime.follow_agent(30); time.sleep(60)"
    env = {**os.environ, "OVERDRIVE_AGENT_PID": "1"}  # not its parent: as if its parent had died
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "is gone; stopping" in proc.stderr
    assert time.monotonic() - started < 10
