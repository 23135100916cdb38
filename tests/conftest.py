"""Shared test fixtures: every test runs with an isolated HF_HOME and no stray config env."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overdrive.launch.tools import installed_tools_first

REPO = Path(__file__).resolve().parents[1]
# Accelerate's and Transformers' own config files, copied with the tests (see the README there).
PEER_CONFIGS = REPO / "tests" / "fixtures" / "peer-configs"
# A larger collection beside the checkout, when there is one, adds cases (skipped when absent).
SHARED_PEER_CONFIGS = Path(os.environ.get("OVERDRIVE_PEER_CONFIGS") or REPO.parent / "shared" / "peer-configs")
NO_SHARED_PEER_CONFIGS = f"no {SHARED_PEER_CONFIGS} beside the checkout: only tests/fixtures/peer-configs is read"

# As the `overdrive` command arranges for itself: the venv's tools first on PATH, so DeepSpeed's
# just-in-time ops are built by the venv's ninja in the test process and in every process it
# starts, once, not rebuilt by whichever ninja each process happens to find.
installed_tools_first()


def peer_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".json")) if root.is_dir() else []


@pytest.fixture(autouse=True)
def isolated_environment(tmp_path_factory, monkeypatch):
    """No Accelerate default config, no ACCELERATE_*/FSDP_*/OVERDRIVE_* variables leaking in,
    and none leaking out: code run in-process (a lone DeepSpeed or FSDP accelerator sets rank
    variables, a CPU run sets DS_ACCELERATOR) must not make a later test look like a worker."""
    saved = dict(os.environ)
    home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_HOME", str(home))
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_", "OVERDRIVE_")):
            monkeypatch.delenv(name)
    yield
    monkeypatch.undo()
    os.environ.clear()
    os.environ.update(saved)
    _fresh_accelerate_state()


def _fresh_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons (precision, device, distributed type): a test that
    built an Accelerator in-process must not leave its state to the next one, which would refuse to
    build its own ("AcceleratorState has already been initialized")."""
    if "accelerate.state" not in sys.modules:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def free_port() -> int:
    """A port nothing listens on now, for a job's rendezvous (a second job could still take
    it first: single-machine jobs move to another port themselves)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cfg_of(*cli: str):
    """The RunConfig of these command-line items, resolved as `overdrive explain` would, without
    the environment or an Accelerate default file."""
    from overdrive.resolving import load_config

    return load_config(cli=list(cli), env={})


def run_here(*args: str) -> subprocess.CompletedProcess:
    """`overdrive ARGS` in this process (cli.main, its stdout and stderr caught): for a test that
    only reads an exit code or a message, without the second or two a fresh interpreter costs."""
    import contextlib
    import io

    from overdrive import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["overdrive", *args], code or 0, out.getvalue(), err.getvalue())


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `overdrive ARGS` as a user types it, in a fresh interpreter."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "overdrive.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)
