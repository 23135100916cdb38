"""`overdrive preflight` through the job's own launcher: measured bandwidth, a busy port
swapped (one machine) or refused naming the key (several), and two launchers on 127.0.0.1
given different configs refused with the difference named."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from conftest import free_port

pytestmark = pytest.mark.slow

TINY = ["model.architecture.n_layer=1", "model.architecture.n_embd=32", "model.architecture.n_head=2",
        "model.architecture.n_positions=64", "tokenizer.vocab_size=512", "data.max_length=32"]


def preflight(*items: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "overdrive.cli", "preflight", *TINY, *items], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_bandwidth_a_busy_port_and_machines_that_disagree(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        chosen = preflight("launch.num_processes=2", f"launch.main_process_port={port}",
                           f"output_dir={tmp_path / 'chosen'}", cwd=tmp_path)
        _, err = chosen.communicate(timeout=120)
        assert chosen.returncode == 2 and "launch.main_process_port" in err and f"port {port}" in err, err[-2000:]
        # Nobody chose the port: the rendezvous takes one of its own.
        one = preflight("launch.num_processes=2", f"output_dir={tmp_path / 'one'}", cwd=tmp_path)
        out, err = one.communicate(timeout=300)
        assert one.returncode == 0, err[-3000:]
        assert "all-reduce" in out and "bus bandwidth" in out and ("GB/s" in out or "MB/s" in out), out
        # Several machines: the port is everyone's meeting point, so machine 0 refuses instead.
        several = ["launch.num_processes=2", "launch.num_machines=2", "launch.main_process_ip=127.0.0.1"]
        refused = preflight(*several, "launch.machine_rank=0", f"launch.main_process_port={port}",
                            f"output_dir={tmp_path / 'busy'}", cwd=tmp_path)
        _, err = refused.communicate(timeout=120)
        assert refused.returncode == 2 and "launch.main_process_port" in err, err[-2000:]
    # Two launchers on 127.0.0.1 as two machines, one given another learning rate.
    port, shared = free_port(), tmp_path / "shared"
    machines = [preflight(*several, f"launch.machine_rank={m}", f"launch.main_process_port={port}",
                          f"output_dir={shared}", f"optim.lr={lr}", cwd=tmp_path)
                for m, lr in ((0, "3e-4"), (1, "1e-3"))]
    for proc in machines:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert "optim.lr" in err and "on machine 1" in err, err[-3000:]
