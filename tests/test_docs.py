"""Every command shown in the docs runs: each ```bash block of README.md and docs/*.md is
executed as written, in a scratch directory holding the files the docs refer to.

The job is shrunk through the environment layer (OVERDRIVE_* variables), which sits below
the command line: a command that sets a key itself still gets its own value. Installing
(`bash scripts/setup.sh`) is what CI does before these tests run, so that step is dropped,
and so is the README's test command, which is what runs this file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PEER_CONFIGS, REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)

TOY = {
    "OVERDRIVE_TRAINING__MAX_STEPS": "2",
    "OVERDRIVE_TRAINING__MICRO_BATCH_SIZE": "4",
    "OVERDRIVE_TRAINING__EVAL_BATCHES": "1",
    "OVERDRIVE_TRAINING__LOG_EVERY_STEPS": "1",
    "OVERDRIVE_SCHEDULER__WARMUP_STEPS": "0",
    "OVERDRIVE_MODEL__ARCHITECTURE__N_LAYER": "1",
    "OVERDRIVE_MODEL__ARCHITECTURE__N_EMBD": "32",
    "OVERDRIVE_MODEL__ARCHITECTURE__N_HEAD": "2",
    "OVERDRIVE_DATA__MAX_BYTES": "200000",
    "OVERDRIVE_DATA__MAX_LENGTH": "32",
    "OVERDRIVE_TOKENIZER__VOCAB_SIZE": "512",
    "OVERDRIVE_LAUNCH__USE_CPU": "true",
    "OVERDRIVE_LOGGING__TRACKERS": "[]",
}

USER_SCRIPT = '''\
"""A plain Accelerate script: everything about how to run comes from the environment."""
import torch
from accelerate import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for x, y in data:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
accelerator.print(f"user script done on {accelerator.num_processes} process(es), {accelerator.distributed_type}")
'''


def bash_blocks(path: Path) -> list[str]:
    blocks = []
    for block in BLOCK.findall(path.read_text()):
        block = block.replace("bash scripts/setup.sh && ", "")
        # The README's test command is what runs this file: running it here would recurse.
        lines = [line for line in block.splitlines()
                 if line.strip() != "bash scripts/setup.sh" and "-m pytest" not in line]
        blocks.append("\n".join(lines))
    return blocks


def scratch_dir(tmp_path: Path) -> Path:
    """The files the docs name, as a user would have them."""
    work = tmp_path / "work"
    shutil.copytree(REPO / "configs", work / "configs")
    shutil.copytree(REPO / "examples", work / "examples")
    (work / ".venv").mkdir()
    (work / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    (work / "run.yaml").write_text("optim:\n  lr: 1.0e-3\noutput_dir: runs/run\n")
    shutil.copy(PEER_CONFIGS / "transformers/tests/deepspeed/ds_config_zero2.json", work / "ds_config.json")
    (work / "accelerate_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: 'no'\n"
        "num_processes: 1\nuse_cpu: false\ndeepspeed_config:\n  zero_stage: 2\n  zero3_init_flag: false\n")
    (work / "train.py").write_text(USER_SCRIPT)
    return work


PAGES = [path for path in DOCS if bash_blocks(path)]


def test_the_docs_have_commands():
    assert sum(len(bash_blocks(path)) for path in PAGES) >= 10


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_command_block_runs(path, tmp_path):
    # One scratch directory per page: its blocks build on each other (train, then report).
    work = scratch_dir(tmp_path)
    env = dict(os.environ, **TOY, OVERDRIVE_DATA__CACHE_DIR=str(tmp_path / "cache"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for index, block in enumerate(bash_blocks(path)):
        result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block + "\nwait\n"], cwd=work, env=env,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (f"{path.name} block {index}:\n{block}\n--- stdout\n{result.stdout[-3000:]}"
                                        f"\n--- stderr\n{result.stderr[-3000:]}")
