"""`overdrive ARGS` in a process forked from an interpreter that has already imported torch.

Most of a short `overdrive train` is the new interpreter's imports (torch alone is about a
second and a half of CPU, two with what comes with it), and the suite starts a few hundred.
Each test worker keeps one warm server: a plain interpreter that imports only libraries whose
import reads nothing the tests vary (torch, numpy, scipy, PIL, pydantic, overdrive's config
layer) and forks a child per command. The child is a new process in a session of its own, with
the command's environment, working directory, argv and output files, and runs `cli.main` as
`python -m overdrive.cli` would: what it imports afterwards (Transformers, Accelerate,
DeepSpeed, the Hugging Face hub) reads the command's own environment. A process started by the
command (torch.distributed.run and its workers) is a fresh interpreter as before.

A command whose environment differs from the server's in a variable read when those libraries
load (OpenMP, MKL, torch, CUDA, the loader, Python's own) runs in a fresh interpreter instead;
so does a test that needs a real child of its own (signals, a Popen it reads as it goes).
`overdrive tune` forks its trials the same way (overdrive/tune/processes.py).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

TESTS = Path(__file__).resolve().parent
PRELOAD = ["torch", "torch.distributed.tensor", "numpy", "scipy.optimize", "PIL.Image", "pydantic", "yaml",
           "psutil", "overdrive.cli", "overdrive.resolving", "overdrive.commands.train"]
# Read when the preloaded libraries load: a command that sets one differently needs a fresh interpreter.
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "LD_", "PYTHON", "MALLOC_")


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(READ_AT_IMPORT)}


class _Server:
    def __init__(self) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="overdrive-warm-"))
        self.env = dict(os.environ)
        code = "import sys; sys.path.insert(0, sys.argv[1]); from warm_start import serve; serve()"
        with (self.scratch / "server.log").open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(TESTS)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                         start_new_session=True, env=self.env)
        self.lock = threading.Lock()
        self.count = 0

    def serves(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and _read_at_import(env) == _read_at_import(self.env)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with self.lock:
            self.count += 1
            files = {part: str(self.scratch / f"{self.count}.{part}") for part in ("out", "err", "exit")}
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd), **files}) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            if not reply:
                raise RuntimeError("the warm server has stopped: " + (self.scratch / "server.log").read_text()[-2000:])
            pid = json.loads(reply)["pid"]
        exit_file = Path(files["exit"])
        deadline = time.monotonic() + timeout
        while not exit_file.exists():
            if time.monotonic() > deadline:
                from overdrive.tune.processes import kill_tree

                kill_tree(pid)
                raise subprocess.TimeoutExpired(["overdrive", *argv], timeout)
            time.sleep(0.02)
        code = int(exit_file.read_text())
        out, err = (Path(files[part]).read_text(errors="replace") for part in ("out", "err"))
        for path in files.values():
            Path(path).unlink(missing_ok=True)
        return subprocess.CompletedProcess([sys.executable, "-m", "overdrive.cli", *argv], code, out, err)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


_server: Optional[_Server] = None


def run_overdrive(argv: list[str], env: dict[str, str], cwd: Optional[Path] = None,
                  timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m overdrive.cli ARGV` with this environment and working directory, its output
    caught: forked from the warm server when the environment allows, else a fresh interpreter."""
    global _server
    cwd = Path(cwd or os.getcwd())
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
        atexit.register(_server.close)
    if not _server.serves(env):
        return subprocess.run([sys.executable, "-m", "overdrive.cli", *argv], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=timeout)
    return _server.run(argv, env, cwd, timeout)


# ------------------------------------------------------------------ inside the server

def serve() -> None:
    """Import once, then fork one child per request line on stdin (the loop `overdrive tune`
    forks its trials with); each child's exit code is written to its exit file."""
    from overdrive.tune.processes import serve as fork_per_request

    fork_per_request(PRELOAD, run=_command)


def _command(request: dict) -> int:
    """In the forked child (its own session, stdin from /dev/null): the command as
    `python -m overdrive.cli` runs it, in the request's directory and environment."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["out"]), (2, request["err"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    from overdrive import cli

    sys.argv = [cli.__file__, *request["argv"]]
    try:
        code = cli.main(request["argv"]) or 0
    except SystemExit as stop:  # as the interpreter ends on one: a message is printed, exit 1
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    atexit._run_exitfuncs()  # as at the end of an interpreter: trackers and logs flushed
    return code
