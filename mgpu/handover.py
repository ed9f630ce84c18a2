"""A submit to the cluster ``mgpu cluster up`` started, handed to a process that imported
the client side already.

Beyond its job, a submit's command spends most of its time importing: Python's start,
Dask, distributed's client, NumPy and pydantic, 0.5-0.7 s of the 0.7-0.9 s it took on an
H100 host. ``cluster up`` therefore also starts a submit server
(:mod:`mgpu.submit_server`) that has imported all of that once. A ``mgpu submit`` that
would join that cluster hands itself over first thing (from ``import mgpu``): its
arguments, environment, working folder and its standard streams (their file descriptors,
so the output reaches its terminal or pipes as its own would). A process the server forked
ahead, connected to the scheduler already, runs the command as this one would have; this
one passes on the signals it gets (Ctrl-C cancels the job as before) and ends with that
process's exit code.

Handed over only where the run is the same: the same interpreter, the same mgpu (its files
unchanged since the server imported them), the same module path. Where they differ, or no
server answers, the command runs itself as before.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any, NoReturn

__all__ = ["JOINS_ELSEWHERE", "fingerprint", "hand_over_command", "recorded", "request"]

# Options after which a submit joins no cluster ``cluster up`` started, or starts none.
JOINS_ELSEWHERE = ("--scheduler", "--scheduler-file", "--dry-run", "--own-cluster", "--help", "-h")
# The signals passed on to the process that runs the command (Ctrl-Z: see _follow).
_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCONT)


def recorded() -> dict[str, Any] | None:
    """``mgpu cluster up``'s record, where it names a process that runs; else None.

    Read without Dask's configuration, where it is unless a Dask configuration file moves
    mgpu's cache folder: a record missed is a command that runs itself (as before), and one
    whose process id was reused is a server that does not answer.
    """
    folder = os.environ.get("DASK_MGPU__CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mgpu"
    )
    try:
        with open(os.path.join(folder, "cluster.json")) as f:
            record = json.load(f)
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def request() -> dict[str, Any]:
    """What the server needs to run this command as this process would."""
    return {
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "executable": sys.executable,
        "path": sys.path,
        "package": __file__,  # which mgpu
        "fingerprint": fingerprint(),  # and whether its files changed since the server imported them
        "streams": [[getattr(s, "encoding", None), getattr(s, "errors", None)] for s in (sys.stdin, sys.stdout)],
    }


def fingerprint(folder: str | None = None) -> list[int]:
    """The number of mgpu's Python files and the newest of their modification times (ns),
    under ``folder`` (mgpu's own by default): where a file was edited, added or removed
    since the server imported mgpu, the command runs itself, with the files as they are."""
    newest, count = 0, 0
    todo = [folder or os.path.dirname(__file__)]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and entry.name != "__pycache__":
                    todo.append(entry.path)
                elif entry.name.endswith(".py"):
                    newest, count = max(newest, entry.stat().st_mtime_ns), count + 1
    return [count, newest]


def hand_over_command() -> None:
    """In the ``mgpu`` command, a ``submit`` that would join the cluster ``cluster up``
    started: hand it to that cluster's submit server and end with its exit code. Returns
    where it was not handed over (then the command runs itself)."""
    from .lifetime import is_command

    args = sys.argv[1:]
    if not is_command() or args[:1] != ["submit"] or any(a.split("=")[0] in JOINS_ELSEWHERE for a in args):
        return
    record = recorded()
    if record is None or not isinstance(record.get("submit"), str):
        return
    # A Ctrl-Z before _follow's handlers are in would stop this process and not the
    # command: it waits, blocked, until they are.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTSTP])
    conn = None
    try:
        conn = _connect(record["submit"])
    finally:
        if conn is None:  # not handed over (or a failure): Ctrl-Z as before
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTSTP])
    if conn is not None:
        _follow(*conn)


def _connect(name: str) -> tuple[socket.socket, Any, int] | None:
    """Hand the command to the server listening at abstract socket ``name``: the
    connection, its reader and the process that runs the command, or None where the server
    did not take it (none listens, or it refused: see :func:`mgpu.submit_server.compatible`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        data = (json.dumps(request()) + "\n").encode()
        sent = socket.send_fds(sock, [data], [0, 1, 2])
        sock.sendall(data[sent:])
        reader = sock.makefile("rb")
        answer = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):  # no server, or a stream of this process closed
        sock.close()
        return None
    if not isinstance(answer.get("pid"), int):
        sock.close()
        return None
    return sock, reader, answer["pid"]


def _follow(sock: socket.socket, reader: Any, pid: int) -> NoReturn:
    """Pass this process's signals on to ``pid``, the process running the command, and end
    as it ends."""

    def pass_on(signum: int, frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def stop_both(signum: int, frame: Any) -> None:
        # Ctrl-Z stops the command as it would stop it in this process; fg or bg continues it.
        pass_on(signal.SIGSTOP, frame)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # this process stops here until continued
        signal.signal(signal.SIGTSTP, stop_both)
        pass_on(signal.SIGCONT, frame)

    for sig in _PASSED_ON:
        signal.signal(sig, pass_on)
    signal.signal(signal.SIGTSTP, stop_both)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTSTP])  # see hand_over_command
    try:
        answer = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        answer = {}
    sock.close()
    code = answer.get("exit")
    if not isinstance(code, int):
        print("mgpu: the cluster's submit server ended while it ran the command", file=sys.stderr)
        os._exit(1)
    if code < 0:  # ended by a signal: end by the same one, as the command itself would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)
