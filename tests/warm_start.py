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
load (OpenMP, BLAS, numpy, torch, CUDA, tqdm, the loader, Python's own, the temporary
directory) runs in a fresh interpreter instead; so does a test that needs a real child of its
own (signals, a Popen it reads as it goes). As in a fresh interpreter, the command's process
ends when everything it started has ended, numpy's global generator is seeded anew, and
non-daemon threads are waited for; what stays the server's is Python's string hash seed.
`overdrive tune` forks its trials the same way (overdrive/tune/processes.py).

The switch `fresh_interpreters(True)` (pytest `--fresh-interpreters`, and every test marked
`fresh_interpreter`) turns the warm start off: every command is a new interpreter, as a user's
shell starts it, so nothing the server imported ahead can hide an import-order or start-up fault.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import shlex
import socket
import stat
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
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_", "BLIS_", "NPY_", "NUMPY_", "SCIPY_", "TORCH",
                  "PYTORCH_", "CUDA_", "NVIDIA_", "TQDM_", "LD_", "PYTHON", "MALLOC_", "TMPDIR")


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(READ_AT_IMPORT)}


class _Server:
    def __init__(self) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="overdrive-warm-"))
        self.env = dict(os.environ)
        code = "import sys; sys.path.insert(0, sys.argv[1]); from warm_start import serve; serve(sys.argv[2])"
        with (self.scratch / "server.log").open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(TESTS), str(self.scratch)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                         start_new_session=True, env=self.env)
        self.lock = threading.Lock()  # one request on the pipe at a time
        self.numbers = itertools.count(1)  # names of each command's files

    def serves(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and _read_at_import(env) == _read_at_import(self.env)

    def start(self, request: dict) -> tuple[int, Path]:
        """Fork the command's process: (its pid, the file its exit code will be written to)."""
        exit_file = self.scratch / f"{next(self.numbers)}.exit"
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps({**request, "exit": str(exit_file)}) + "\n")
                self.proc.stdin.flush()
                reply = self.proc.stdout.readline()
            except OSError:
                reply = ""
        if not reply:
            raise self.stopped()
        return json.loads(reply)["pid"], exit_file

    def stopped(self) -> RuntimeError:
        log = self.scratch / "server.log"
        return RuntimeError("the warm server has stopped: " + (log.read_text()[-2000:] if log.exists() else ""))

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        number = next(self.numbers)
        out, err = self.scratch / f"{number}.out", self.scratch / f"{number}.err"
        pid, exit_file = self.start({"argv": argv, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)})
        code = wait_for_exit(self, pid, exit_file, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(["overdrive", *argv], timeout)
        done = subprocess.CompletedProcess([sys.executable, "-m", "overdrive.cli", *argv], code,
                                           out.read_text(), err.read_text())
        for path in (out, err, exit_file):
            path.unlink(missing_ok=True)
        return done

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        shutil.rmtree(self.scratch, ignore_errors=True)


def wait_for_exit(server: _Server, pid: int, exit_file: Path, timeout: float = float("inf"),
                  caller: Optional[int] = None) -> Optional[int]:
    """The exit code of a forked command; None when it was killed (with everything it started)
    for running past `timeout`, or because the process it was run for (`caller`) is gone. A
    server that dies meanwhile (no one left to write the exit code) is an error at once."""
    from overdrive.tune.processes import kill_tree

    deadline = time.monotonic() + timeout
    while not exit_file.exists():
        if server.proc.poll() is not None:
            raise server.stopped()
        if time.monotonic() > deadline or (caller and not Path(f"/proc/{caller}").exists()):
            kill_tree(pid)
            return None
        time.sleep(0.02)
    return int(exit_file.read_text())


_server: Optional[_Server] = None
_starting = threading.Lock()  # relay threads ask for the server too


def _warm_server() -> _Server:
    global _server
    with _starting:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
            atexit.register(_server.close)
        return _server


_fresh = False  # every command a new interpreter (fresh_interpreters)


def fresh_interpreters(on: bool) -> bool:
    """Every command from now on in a new interpreter (True) or forked warm where it can be
    (False); returns the setting it replaced."""
    global _fresh
    before, _fresh = _fresh, on
    return before


def run_overdrive(argv: list[str], env: dict[str, str], cwd: Optional[Path] = None,
                  timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m overdrive.cli ARGV` with this environment and working directory, its output
    caught: forked from the warm server when the environment allows, else a fresh interpreter."""
    cwd = Path(cwd or os.getcwd())
    if _fresh or not _warm_server().serves(env):
        return subprocess.run([sys.executable, "-m", "overdrive.cli", *argv], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=timeout)
    return _warm_server().run(argv, env, cwd, timeout)


# ------------------------------------------------------------------ `overdrive` typed in a shell

# The stand-in `overdrive` a shell finds first on PATH: it hands its command line, environment,
# directory and standard streams to the test worker's relay (tests/warm_client.py).
STAND_IN = """#!/bin/sh
OVERDRIVE_WARM_RELAY={socket} exec {python} -S {client} "$@"
"""
# The same command under fresh_interpreters: a new interpreter, as the installed entry point is.
FRESH_STAND_IN = """#!/bin/sh
exec {python} -m overdrive.cli "$@"
"""
# What a forked command can open again through /proc and share with its caller: a pipe (what a
# test reads), a terminal, /dev/null. A regular file would be a second open file, its offset
# not shared with the shell's (a shell writing after the command would overwrite its output).
SHAREABLE = (stat.S_ISFIFO, stat.S_ISCHR)


def stand_in(bin_dir: Path) -> Path:
    """Write the stand-in `overdrive` into `bin_dir` (put it first on PATH): a command a shell
    runs (a docs block) is then forked from the warm server, with the shell's own standard
    streams, and signals sent to it reach the command. Returns `bin_dir`."""
    path = bin_dir / "overdrive"
    if _fresh:
        path.write_text(FRESH_STAND_IN.format(python=shlex.quote(sys.executable)))
    else:
        path.write_text(STAND_IN.format(socket=shlex.quote(_relay()), python=shlex.quote(sys.executable),
                                        client=shlex.quote(str(TESTS / "warm_client.py"))))
    path.chmod(0o755)
    return bin_dir


_relay_path: Optional[str] = None


def _relay() -> str:
    """The unix socket this test worker answers stand-in commands on (a thread per command)."""
    global _relay_path
    if _relay_path is None:
        listener = socket.socket(socket.AF_UNIX)
        path = str(_warm_server().scratch / "relay.sock")
        listener.bind(path)
        listener.listen(16)
        threading.Thread(target=_accept, args=(listener,), daemon=True).start()
        _relay_path = path
    return _relay_path


def _shareable(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:  # closed
        return False
    return any(kind(mode) for kind in SHAREABLE)


def _accept(listener: socket.socket) -> None:
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_answer, args=(connection,), daemon=True).start()


def _answer(connection: socket.socket) -> None:
    """One stand-in command: fork it with the caller's streams (through /proc), tell the caller
    its pid (to pass signals on), then its exit code. A command the server cannot run as a
    fresh interpreter would (its environment; a stream that is a file, closed, or a socket) is
    answered `fresh`: the caller runs a fresh interpreter itself."""
    with connection, connection.makefile("rw") as stream, contextlib.suppress(OSError, ValueError):  # caller gone
        request = json.loads(stream.readline())
        server = _warm_server()
        caller = request.pop("caller")
        streams = {name: f"/proc/{caller}/fd/{fd}" for fd, name in enumerate(("in", "out", "err"))}
        if not server.serves(request["env"]) or not all(map(_shareable, streams.values())):
            stream.write(json.dumps({"fresh": True}) + "\n")
            return
        pid, exit_file = server.start({**request, **streams, "inherit": True})
        stream.write(json.dumps({"pid": pid}) + "\n")
        stream.flush()
        code = wait_for_exit(server, pid, exit_file, caller=caller)
        exit_file.unlink(missing_ok=True)
        if code is not None:
            stream.write(json.dumps({"exit": code}) + "\n")


# ------------------------------------------------------------------ inside the server

def serve(scratch: str) -> None:
    """Import once, then fork one child per request line on stdin (the loop `overdrive tune`
    forks its trials with); each child's exit code is written to its exit file. At the end of
    input (the test worker has finished, or died) the scratch directory goes too."""
    from overdrive.tune.processes import serve as fork_per_request

    try:
        fork_per_request(PRELOAD, run=_command)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _command(request: dict) -> int:
    """In the forked child (its own session, stdin from /dev/null): the command as
    `python -m overdrive.cli` runs it, in the request's directory and environment, ended as an
    interpreter ends (non-daemon threads joined, exit handlers run) and only once every process
    it started has ended (as `subprocess.run` waits for the last holder of its pipes)."""
    import ctypes

    import numpy

    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: what it starts and leaves is ours to wait for
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # torch's import fixed it from the server's TMPDIR
    numpy.random.seed()  # from the OS, as each new interpreter's is
    # A caller's own streams (a shell's pipe or terminal) are opened again through /proc; a
    # test's files from empty. stderr first: a failure to open the others is said there.
    writing = os.O_WRONLY | os.O_APPEND if request.get("inherit") else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((2, request["err"], writing), (1, request["out"], writing),
                            (0, request.get("in"), os.O_RDONLY)):
        if path:
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
    if request.get("in"):
        sys.stdin = open(0, closefd=False)
    from overdrive import cli

    sys.argv = [cli.__file__, *request["argv"]]
    try:
        code = cli.main(request["argv"]) or 0
    except SystemExit as stop:  # as the interpreter ends on one: a message is printed, exit 1
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    finally:
        threading._shutdown()  # as at the end of an interpreter: non-daemon threads, then exit handlers
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        while True:  # the processes it started and left (now children of this one) end first
            try:
                os.wait()
            except ChildProcessError:
                break
    return code
