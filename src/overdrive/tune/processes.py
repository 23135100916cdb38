"""Starting trial processes, and killing them together with everything they started.

- `ForkServer` (default): one fresh interpreter imports torch, transformers, accelerate and
  datasets once, then forks a child per trial on request. Each child is a new process with
  its own session and memory, started from a state in which nothing but imports has
  happened (no thread pool, no device, no process group): the same state a fresh
  `overdrive train` reaches ~5 s later. Those seconds would otherwise dominate short trials.
- `Spawner`: a fresh interpreter per trial.

Both run `trials.run_resolved` (or `trials.prepare_data`) on a resolved config file, with
stdout and stderr going to the trial's log. The server is a plain `os.fork()` loop rather
than multiprocessing's forkserver, which would re-import the caller's `__main__` script in
every child and hand the children its own start method.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn, Optional

PRELOAD = ["torch", "accelerate", "datasets", "transformers", "overdrive.training.loop", "overdrive.strategies",
           "overdrive.launch", "overdrive.tune.trials"]


def kill_tree(pid: int) -> None:
    """SIGKILL a process, its process group and every descendant (torchrun's workers run in
    sessions of their own, so the group alone would miss them)."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        family = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # not (yet) leading its own group, or already gone
        pass
    for process in family:
        try:
            process.kill()
        except psutil.Error:
            pass


def _run_task(task: str, path: str) -> int:
    from overdrive.tune import trials

    return trials.prepare_data(path) if task == "prepare" else trials.run_resolved(path)


class _Popened:
    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def kill(self) -> None:
        kill_tree(self.pid)
        self.popen.wait()


class Spawner:
    """A fresh interpreter per trial."""

    def __init__(self, env: Optional[dict[str, str]] = None):
        self.env = env

    def start(self, task: str, path: Path, log: Path) -> _Popened:
        code = "import sys; from overdrive.tune.processes import _run_task; sys.exit(_run_task(sys.argv[1], sys.argv[2]))"
        with log.open("ab") as out:
            popen = subprocess.Popen([sys.executable, "-c", code, task, str(path)], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        return _Popened(popen)

    def close(self) -> None:
        pass


class _Forked:
    def __init__(self, pid: int, exit_file: Path):
        self.pid, self.exit_file = pid, exit_file

    def poll(self) -> Optional[int]:
        try:
            return int(self.exit_file.read_text())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        kill_tree(self.pid)


class ForkServer:
    """Forks trials from a warm interpreter (see the module docstring)."""

    def __init__(self, workdir: Path, env: Optional[dict[str, str]] = None, preload: tuple[str, ...] = ()):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "fork-server.log"
        modules = list(dict.fromkeys([*PRELOAD, *preload]))
        code = "import sys, json; from overdrive.tune.processes import serve; serve(json.loads(sys.argv[1]))"
        with self.log.open("ab") as err:
            self.server = subprocess.Popen([sys.executable, "-c", code, json.dumps(modules)], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
                                           text=True, bufsize=1)

    def start(self, task: str, path: Path, log: Path) -> _Forked:
        exit_file = Path(f"{log}.exit")
        exit_file.unlink(missing_ok=True)  # an earlier run's in the same directory (a resumed sweep trial)
        try:
            self.server.stdin.write(json.dumps({"task": task, "path": str(path), "log": str(log),
                                                "exit": str(exit_file)}) + "\n")
            self.server.stdin.flush()
            reply = self.server.stdout.readline()
        except OSError:
            reply = ""
        if not reply:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"the trial fork server has stopped: {tail.strip() or 'no output'}")
        return _Forked(json.loads(reply)["pid"], exit_file)

    def close(self) -> None:
        try:
            self.server.stdin.close()
            self.server.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            kill_tree(self.server.pid)
            self.server.wait()


# ------------------------------------------------------------------ inside the server

def serve(modules: list[str], run: Optional[Callable[[dict], int]] = None) -> None:
    """The fork server's loop: import once, then one fork per request line on stdin; the
    child returns `run(request)` as its exit code (default: a trial), written to the request's
    `exit` file when it is reaped. The test suite's warm starts use the same loop."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # a missing optional module only costs the child its import
            print(f"preload {name}: {error}", file=sys.stderr)
    exits: dict[int, str] = {}

    def reap(*_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = exits.pop(pid, None)
            if path:
                from overdrive.storage.whole_file import replace_whole

                replace_whole(path, str(os.waitstatus_to_exitcode(status)))  # the tuner never reads half a number

    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        request = json.loads(line)
        # SIGCHLD is held back until the child's pid is on record: a child that exits at
        # once is then still reaped into its exit file.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            _child(request, run or _trial)
        exits[pid] = request["exit"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(json.dumps({"pid": pid}), flush=True)
    # End of input: the tuner has finished, or died. No trial may outlive it.
    for pid in list(exits):
        kill_tree(pid)
    reap()


def _trial(request: dict) -> int:
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return _run_task(request["task"], request["path"])


def _child(request: dict, run: Callable[[dict], int]) -> NoReturn:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        # Own session: the tuner kills the trial's whole group, and a Ctrl-C meant for the
        # tuner does not reach it (the tuner kills it on the way out).
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(os.devnull)  # not the server's, which may hold the next request read ahead
        code = run(request)
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never return into the server's loop
