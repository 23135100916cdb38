"""Every command shown in the docs runs: each ```bash block of README.md and docs/*.md is
executed as written, in a scratch directory holding the files the docs refer to.

The job is shrunk through the environment layer (OVERDRIVE_* variables), which sits below
the command line: a command that sets a key itself still gets its own value. Installing
(`bash scripts/setup.sh`) is what CI does before these tests run, so that step is dropped,
and so is the README's test command, which is what runs this file.

A block fails on its first failing command (`set -euo pipefail`), and also when a command it
started in the background (`&`) failed (checked with `wait -n -p`, bash 5.1 or later). A line
starting with `! ` shows a command that must fail (a refusal): bash's `set -e` would not check
it, so the test does. A block also fails when it warns (overdrive's `warning:` lines, a
Python `...Warning:`, a library logger's `[WARNING]`), unless it says `# warnings expected:` and why.

What one CPU-only machine without a network cannot run stays in ```text blocks, each with a
sentence naming the block that rehearses it: the two-machine commands of multi-node.md.
There is no SLURM here either: `sbatch` on the test's PATH is a stand-in that checks the
script's syntax with `bash -n` and says that it submitted nothing. `overdrive` on the PATH is
the real command: a subcommand the pages show for the first time (in their order) starts in a
new interpreter, as a user's shell starts it, so nothing imported ahead hides a start-up fault
of any documented command; every later use of it is forked from an interpreter that has
imported torch (tests/warm_start.py), with the shell's streams, signals and exit code.
`.venv/bin/overdrive` is always a new interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PEER_CONFIGS, REPO, free_port

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
# What a page needs beyond TOY. checkpoints.md stops a run once its first step is logged, and
# the run must still be going when the signal comes: 2000 steps (a few seconds), one thread so
# that another busy process on the machine cannot slow it down by orders of magnitude either.
PAGE_ENV = {
    "checkpoints.md": {"OVERDRIVE_TRAINING__MAX_STEPS": "2000", "OVERDRIVE_LAUNCH__THREADS_PER_PROCESS": "1"},
}

# LLaMA-7B's config.json (LlamaConfig's keys), for the memory estimates.
LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 2048, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

# No SLURM here: `sbatch` checks the script it is given and submits nothing.
SBATCH = """#!/usr/bin/env bash
script="${@: -1}"
bash -n "$script" && echo "sbatch (test stand-in): $script is valid bash; nothing submitted, there is no SLURM here"
"""

# After a block: every command it started with `&` must have succeeded too.
BACKGROUND_CHECK = """
while true; do
  __job=; wait -n -p __job && continue
  __status=$?; [ -z "${__job:-}" ] && break
  echo "a command started in the background (pid $__job) exited with $__status" >&2; exit "$__status"
done
"""

USER_SCRIPT = '''\
"""A plain Accelerate script: everything about how to run comes from the environment."""
import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator()
# Token ids in, as in a language model: the weights may be bf16 (DeepSpeed casts them), the input needs no cast.
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
samples = torch.utils.data.TensorDataset(torch.randint(0, 16, (64,)), torch.randn(64, 1))
data = torch.utils.data.DataLoader(samples, batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for x, y in data:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
accelerator.print(f"user script done on {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
                  f"arguments {sys.argv[1:]}")
'''


WARNING = re.compile(r"^(overdrive: warning: .*|.*\b\w*Warning: .*|.*\[WARNING\].*)$", re.M)


def warnings_in(stderr: str) -> list[str]:
    """The warning lines of a command's stderr: overdrive's, Python's (`...Warning: `), a library logger's."""
    return WARNING.findall(stderr)


def must_fail(line: str) -> str:
    """`! command` shows a command that must fail. Under `set -e` bash ignores the status of a
    negated command, so it is checked explicitly."""
    command = line[2:]
    assert not command.rstrip().endswith("\\"), f"a `! ` command is one line: {line}"
    return (f"if {command}\nthen echo {shlex.quote('expected to fail, but succeeded: ' + command)} >&2; exit 1\nfi")


def bash_blocks(path: Path) -> list[str]:
    blocks = []
    for block in BLOCK.findall(path.read_text()):
        block = block.replace("bash scripts/setup.sh && ", "")
        # The README's test command is what runs this file: running it here would recurse.
        lines = [must_fail(line) if line.startswith("! ") else line for line in block.splitlines()
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
    (work / "run.yaml").write_text("optim:\n  lr: 3.0e-4\noutput_dir: runs/run\n")
    shutil.copy(PEER_CONFIGS / "transformers/tests/deepspeed/ds_config_zero2.json", work / "ds_config.json")
    (work / "accelerate_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: 'no'\n"
        "num_processes: 1\nuse_cpu: false\ndeepspeed_config:\n  zero_stage: 2\n  zero3_init_flag: false\n")
    (work / "train.py").write_text(USER_SCRIPT)
    llama = json.dumps(LLAMA_7B, indent=2) + "\n"
    (work / "path" / "to" / "llama-7b").mkdir(parents=True)
    (work / "path" / "to" / "llama-7b" / "config.json").write_text(llama)
    (work / "config.json").write_text(llama)
    return work


# `overdrive` on a page's PATH: the subcommands in `fresh` in a new interpreter, the others warm.
DISPATCH = """#!/bin/sh
case "$1" in
  {fresh}) exec {python} -m overdrive.cli "$@" ;;
esac
exec {warm} "$@"
"""
SUBCOMMAND = re.compile(r"(?:^|[\s;&|(])overdrive (\w+)")  # `.venv/bin/overdrive` is a new interpreter anyway
started_fresh: set[str] = set()  # the subcommands an earlier page of this test worker started new


def subcommands(path: Path) -> set[str]:
    return {name for block in bash_blocks(path) for name in SUBCOMMAND.findall(block)}


def stand_ins(tmp_path: Path, fresh: set[str]) -> Path:
    """Commands the docs show that this machine has no real use for, and `overdrive` (the
    subcommands in `fresh` a new interpreter, the others warm; every one a new interpreter under
    tests/warm_start.py's fresh_interpreters), put first on PATH."""
    from warm_start import stand_in

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    warm_dir = tmp_path / "bin-warm"
    warm_dir.mkdir()
    warm = stand_in(warm_dir) / "overdrive"
    if fresh:
        (bin_dir / "overdrive").write_text(DISPATCH.format(fresh="|".join(sorted(fresh)), warm=shlex.quote(str(warm)),
                                                           python=shlex.quote(sys.executable)))
    else:
        (bin_dir / "overdrive").symlink_to(warm)
    (bin_dir / "overdrive").chmod(0o755)
    return bin_dir


PAGES = [path for path in DOCS if bash_blocks(path)]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One data cache for every page: the pages train on the same toy corpus, so the
    tokenizer and the token cache are built once, not once per page (the cache is keyed by
    what it holds, as a user's is)."""
    return tmp_path_factory.mktemp("docs-cache")


def test_the_docs_have_commands():
    assert sum(len(bash_blocks(path)) for path in PAGES) >= 10


# A command that installs or removes packages: run by this test it would change the environment
# every later test runs in (a vLLM extra once replaced Transformers mid-suite). Such commands stay
# in ```text blocks; `bash scripts/setup.sh`, dropped above, is the one install the pages run.
INSTALLS = re.compile(r"(?:^|[\s;&|(/])(?:pip3?|uv pip|conda|mamba|apt(?:-get)?)\s+(?:install|uninstall|remove)\b"
                      r"|-m pip\s+(?:install|uninstall)\b", re.M)


def test_no_block_installs_packages():
    assert INSTALLS.search("x && .venv/bin/python -m pip install y") and INSTALLS.search("pip install 'a[b]'")
    assert not INSTALLS.search("overdrive train  # pip is not called")
    found = [f"{path.name} block {index}: {match.group(0).strip()}" for path in PAGES
             for index, block in enumerate(bash_blocks(path)) for match in INSTALLS.finditer(block)]
    assert not found, "a ```bash block installs packages (make it ```text): " + "; ".join(found)


def test_the_subcommands_a_block_runs_are_found_wherever_the_command_stands():
    block = ("overdrive train  # x\n! overdrive plan a=1\ncd x && overdrive import y\nOVERDRIVE_OPTIM__LR=1 overdrive explain\n"
             ".venv/bin/overdrive tune\n(overdrive env)")
    assert set(SUBCOMMAND.findall(block)) == {"train", "plan", "import", "explain", "env"}


@pytest.mark.slow
@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_command_block_runs(path, tmp_path, shared_cache):
    # One scratch directory per page: its blocks build on each other (train, then report).
    work = scratch_dir(tmp_path)
    env = {**os.environ, **TOY, **PAGE_ENV.get(path.name, {}), "OVERDRIVE_DATA__CACHE_DIR": str(shared_cache),
           "PIP_NO_INDEX": "1"}  # should an install slip past test_no_block_installs_packages, it finds nothing
    if path.name == "multi-node.md":
        # Its two launchers meet at configs/multi-node.yaml's fixed port, which a job of several
        # machines cannot move away from when something else on the machine has it: a free one.
        env["OVERDRIVE_LAUNCH__MAIN_PROCESS_PORT"] = str(free_port())
    # Each documented subcommand once as a user's shell starts it, nothing imported ahead (the
    # first page that shows it); later pages fork it warm: the same command, seconds sooner.
    fresh = subcommands(path) - started_fresh
    started_fresh.update(fresh)
    env["PATH"] = os.pathsep.join([str(stand_ins(tmp_path, fresh)), str(Path(sys.executable).parent), env["PATH"]])
    for index, block in enumerate(bash_blocks(path)):
        result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block + "\n" + BACKGROUND_CHECK], cwd=work,
                                env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (f"{path.name} block {index}:\n{block}\n--- stdout\n{result.stdout[-3000:]}"
                                        f"\n--- stderr\n{result.stderr[-3000:]}")
        # As written, without a warning: overdrive's own, or a library's passed on raw. A block
        # whose warnings are its point (what an import leaves out) says so in a comment.
        warned = [] if "# warnings expected:" in block else warnings_in(result.stderr)
        assert not warned, f"{path.name} block {index} warns:\n{block}\n--- warnings\n" + "\n".join(warned)


def test_warnings_are_found_in_every_form_they_take():
    stderr = ("overdrive: warning: scheduler.warmup_steps: 40 warmup steps >= 20 max_steps\n"
              "/x/accelerate/utils/launch.py:236: UserWarning: Port `29500` is already in use.\n"
              "[2026-01-01 00:00:00,000] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n"
              "training: causal-lm, 20 steps\n")
    assert len(warnings_in(stderr)) == 3
