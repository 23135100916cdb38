"""bench/gpu_check.py on a machine without CUDA: it runs to the end, exit 0, the GPU rows
marked as needing one and a row a CPU can run (the phases adding up to the step) run for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu_to_the_end(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check runs its GPU rows (minutes), run it by hand")
    # The qlora row's CPU runs (FSDP2 against one process) are what
    # test_finetune_runs.py::test_qlora_under_fsdp2_in_bf16_on_two_processes_matches_one already runs: left out here.
    rows_here = "fp16_weights,fp16_overflow,memory,mfu,phases,profile,compile"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(tmp_path),
                           "--only", rows_here], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("\n\n")[-1]
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    for name in ("fp16_weights", "fp16_overflow", "memory", "mfu", "profile", "compile"):
        assert "needs a GPU" in rows[name], table
    assert rows["phases"].split()[1] == "pass", table


def test_the_checks_bar_comes_from_the_precision_and_still_catches_a_defect():
    import sys as _sys

    _sys.path.insert(0, str(REPO / "bench"))
    from gpu_check_rows import within_precision

    plain = [3.5 - 0.2 * i for i in range(10)]
    # What the CPU measured between FSDP2 and one process in bf16: 2.5e-2 apart by step 10.
    sharded = [x + 0.025 * i / 9 for i, x in enumerate(plain)]
    assert within_precision(sharded, plain, "bf16")[0]
    assert not within_precision(sharded, plain, "no")[0]  # the same parting in fp32 is a defect
    untrained = [plain[0]] * 10  # the adapter never updated under one of the two
    assert not within_precision(untrained, plain, "bf16")[0]
    assert not within_precision(plain[:9], plain, "bf16")[0]  # a run that stopped early
