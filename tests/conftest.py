"""Shared test fixtures: every test runs with an isolated HF_HOME and no stray config env."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

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

# Tests share the cores: two at a time (pytest-xdist), and runs of more processes than cores.
# An OpenMP thread waiting for work spins by default, taking a core another process needs; a
# passive one sleeps. Measured here: three one-process runs side by side on two cores took 17-20 s
# spinning against 10 s passive; alone, 6.0 s against 6.5 s. Set before torch loads OpenMP, in
# this process and every process it starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def peer_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".json")) if root.is_dir() else []


@contextlib.contextmanager
def machine_share(alone: bool) -> Iterator[None]:
    """Under pytest-xdist (`-n 2`) two tests run at once. A test marked `alone` judges elapsed
    time (an answer within seconds, one rank slower than the other, a save that blocks less), so
    it waits until it has the machine to itself, and no other test starts until it ends. A
    readers-writer lock shared by the run's workers: every test holds the machine shared, an
    `alone` test holds it exclusively; the turnstile lets no new test in while one waits to be alone."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one test at a time anyway
        yield
        return
    base = Path(tempfile.gettempdir()) / f"overdrive-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


# Seconds the slow tests of each file took, one file after another on a two-core machine
# (`pytest -m slow -p no:xdist --durations=0`, summed per file). Only the order of the files
# depends on it: a stale or missing entry costs balance between the workers, never a result.
FILE_SECONDS: dict[str, int] = json.loads((REPO / "tests" / "file_seconds.json").read_text())


def pytest_collection_modifyitems(session, config, items):
    """The longest files first, each file's tests kept together: pytest-xdist (`--dist loadfile`)
    hands files to its workers in this order, so the long ones start early and the quick ones
    fill the end, rather than one long file running alone at the end. A file with slow tests
    that is not in FILE_SECONDS (a new one) counts as a median one."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    median = sorted(FILE_SECONDS.values())[len(FILE_SECONDS) // 2]

    def seconds(item) -> int:
        return FILE_SECONDS.get(item.path.name, median if item.path in slow_files else 0)

    items.sort(key=lambda item: -seconds(item))


def pytest_addoption(parser):
    parser.addoption("--fresh-interpreters", action="store_true",
                     help="run every `overdrive` command a test starts in a new interpreter, as a user's shell "
                          "does (tests/warm_start.py's warm start off)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The whole of a test, its fixtures' set-up and tear-down included, under `machine_share`;
    in new interpreters only when asked (`--fresh-interpreters`, or the test's `fresh_interpreter` mark)."""
    import warm_start

    fresh = item.config.getoption("--fresh-interpreters") or item.get_closest_marker("fresh_interpreter") is not None
    before = warm_start.fresh_interpreters(fresh)
    try:
        with machine_share(item.get_closest_marker("alone") is not None):
            yield
    finally:
        warm_start.fresh_interpreters(before)


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


@pytest.fixture(autouse=True, scope="module")
def installed_packages_unchanged() -> Iterator[None]:
    """A test file must leave the key packages as it found them. One that installs into the suite's
    environment (a documented `pip install`, once) changes what every later file runs on, and those
    fail far from the cause: this names the file instead."""
    from overdrive.system.tested import KEY_PACKAGES, installed_version

    before = {package: installed_version(package) for package in KEY_PACKAGES}
    yield
    after = {package: installed_version(package) for package in KEY_PACKAGES}
    changed = [f"{package} {before[package]} -> {after[package]}" for package in KEY_PACKAGES
               if before[package] != after[package]]
    assert not changed, "this test file changed the installed packages: " + ", ".join(changed)


def _fresh_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons (precision, device, distributed type): a test that
    built an Accelerator in-process must not leave its state to the next one, which would refuse to
    build its own ("AcceleratorState has already been initialized")."""
    if "accelerate.state" not in sys.modules:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Path:
    """The small Llama of hf_fixtures.make_tiny_llama, saved once per test worker: read it, never
    write into it (a test that changes a model copies it first)."""
    from hf_fixtures import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "base")


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


def refusal(*cli: str, files: tuple = (), env: dict | None = None):
    """The UserError resolving these command-line items (after `files`, with `env` as the
    environment) ends in, as `overdrive explain` would meet it: the tests' one way to ask what a
    config's problems are (`.problems` by key; `.render()` as the user reads them)."""
    from overdrive.errors import UserError
    from overdrive.resolving import resolve

    with pytest.raises(UserError) as error:
        resolve(list(files), cli=list(cli), env=env or {}, accelerate_default=False)
    return error.value


def problems_of(*cli: str, files: tuple = (), env: dict | None = None) -> str:
    """The refusal of these items as the user reads it (`refusal(...).render()`)."""
    return refusal(*cli, files=files, env=env).render()


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
    """Run `overdrive ARGS` as a user types it, in a new process (warm_start: forked from an
    interpreter that has imported torch, when the environment allows)."""
    from warm_start import run_overdrive

    full_env = dict(os.environ)
    full_env.update(env or {})
    return run_overdrive(list(args), full_env, cwd, timeout)
