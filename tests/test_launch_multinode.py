"""Multi-node, simulated: two launchers on 127.0.0.1, machine_rank 0 and 1, one process
each, train one job together; its losses are those of one process at the same global batch."""

from __future__ import annotations

import pytest
from strategy_probe import GLOBAL_BATCH, REPO, TOLERANCE, free_port, losses_of, reference_losses, train

pytestmark = pytest.mark.slow  # every test here starts processes or trains


def test_two_launchers_train_one_job(tmp_path_factory, tmp_path):
    base = tmp_path_factory.getbasetemp()
    expected = reference_losses(base)
    shared = [str(REPO / "configs" / "multi-node.yaml"), "launch.num_processes=2", "launch.num_machines=2",
              "launch.main_process_ip=127.0.0.1", f"launch.main_process_port={free_port()}",
              f"training.micro_batch_size={GLOBAL_BATCH // 2}"]
    machines = [train(*shared, f"launch.machine_rank={rank}", output_dir=tmp_path / "run", cache_dir=base / "cache",
                      wait=False) for rank in (0, 1)]
    outputs = [machine.communicate(timeout=300)[0] for machine in machines]
    for machine, output in zip(machines, outputs):
        assert machine.returncode == 0, output[-4000:]
    got = losses_of(tmp_path / "run")  # written by global rank 0, on machine 0
    assert max(abs(a - b) for a, b in zip(got, expected)) <= TOLERANCE, (got, expected)
    assert len(got) == 4
    # Each machine handed its own copy of the resolved config to its workers.
    assert (tmp_path / "run" / "resolved.json").is_file()
    assert (tmp_path / "run" / "resolved.machine1.json").is_file()
