"""The command line as a user types it: fast start, clear errors, generated docs in sync."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

# Every test here starts processes; each command a new interpreter, as a user's shell starts it.
pytestmark = [pytest.mark.slow, pytest.mark.fresh_interpreter]

HEAVY = ("torch", "transformers", "deepspeed", "accelerate", "datasets")


def _modules_imported_by(*args: str) -> set[str]:
    code = (
        "import sys; from overdrive.cli import main\n"
        f"try:\n    main({list(args)!r})\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.splitlines()[-1].split())


def test_help_and_explain_do_not_import_heavy_libraries():
    for args in (["--help"], ["explain"], ["explain", "lr=1e-3", "--json"], ["explain", "strategy=deepspeed", "zero=3"]):
        loaded = _modules_imported_by(*args)
        assert not loaded & set(HEAVY), (args, loaded & set(HEAVY))


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("train", "explain", "docs"):
        assert command in result.stdout


def test_unknown_command_exits_2():
    result = run_cli("trian")
    assert result.returncode == 2 and "unknown command 'trian'" in result.stderr and "`overdrive train`" in result.stderr


def test_missing_file_is_a_clear_error():
    result = run_cli("explain", "nope.yaml")
    assert result.returncode == 2
    assert "config file not found: nope.yaml" in result.stderr and "Traceback" not in result.stderr


def test_config_reference_is_up_to_date():
    result = run_cli("docs", "--check", "-o", str(REPO / "docs" / "config.md"))
    assert result.returncode == 0, "docs/config.md is stale: run `overdrive docs`"


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`overdrive estimate --json | head -1`: the pipe closes before the output is written."""
    code = ("import sys\nfrom overdrive.boundary import run_reporting_errors\n"
            "def write():\n    while True:\n        sys.stdout.write('x' * 65536)\n"
            "sys.exit(run_reporting_errors(write))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # as `head` does once it has its line
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_the_interpreters_own_tools_come_first_on_path(monkeypatch):
    """DeepSpeed's just-in-time ops are built by the ninja PATH finds: the venv's, as if it
    were activated, whether or not the user activated it."""
    from overdrive.launch.tools import installed_tools_first

    tools = os.path.dirname(sys.executable)
    monkeypatch.setattr(sys, "base_prefix", "/a/base/interpreter")  # as in a venv
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", tools, "/bin"]))
    installed_tools_first()
    first = os.environ["PATH"]
    assert first.split(os.pathsep)[:2] == [tools, "/usr/bin"]
    installed_tools_first()  # a worker started by the launcher: already first, nothing added
    assert os.environ["PATH"] == first
    monkeypatch.delenv("PATH")  # unset: the default lookups stay behind the venv's
    installed_tools_first()
    assert os.environ["PATH"] == os.pathsep.join([tools, os.defpath])
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # a system or --user install: PATH as it was
    monkeypatch.setenv("PATH", "/home/me/.local/bin:/usr/bin")
    installed_tools_first()
    assert os.environ["PATH"] == "/home/me/.local/bin:/usr/bin"
