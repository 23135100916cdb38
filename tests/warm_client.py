"""The stand-in `overdrive` of tests/warm_start.py: run as `python -S`, it imports only the
standard library. It hands its command to the test worker's relay, passes on the signals it is
sent, and exits as the command did (a command killed by a signal: by the same signal)."""

import json
import os
import signal
import socket
import sys


def main() -> None:
    connection = socket.socket(socket.AF_UNIX)
    connection.connect(os.environ.pop("OVERDRIVE_WARM_RELAY"))
    stream = connection.makefile("rw")
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "caller": os.getpid()}
    stream.write(json.dumps(request) + "\n")
    stream.flush()
    reply = json.loads(stream.readline())
    if reply.get("fresh"):  # what a fork would not run as a fresh interpreter (environment, streams)
        os.execv(sys.executable, [sys.executable, "-m", "overdrive.cli", *sys.argv[1:]])
    pid = reply["pid"]
    # To the command's whole process group, as a terminal's Ctrl-C or `kill -- -PGID` would reach
    # the launcher and its agent together (the command leads a session of its own).
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(number) != signal.SIG_IGN:  # a background job's SIGINT stays ignored
            signal.signal(number, lambda received, _: os.killpg(pid, received))
    code = json.loads(stream.readline())["exit"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


main()
