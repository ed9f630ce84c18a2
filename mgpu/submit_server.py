"""The submit server of a cluster ``mgpu cluster up`` started: a process that has imported
the client side once, and forks a process for each ``mgpu submit`` handed to it
(:mod:`mgpu.handover`) that runs the command as the submit's own process would have.

It listens on an abstract Unix socket named in the cluster's record, and takes commands
only from processes of its own user. ``cluster up``'s process starts it in its process
group (``down`` ends it with the cluster), writes the scheduler's address to its standard
input once the cluster is up, and holds that pipe open: the server ends when that process
does.

One process is forked ahead, before any command comes: it connects a client to the
scheduler (:func:`mgpu.connection.ahead`, the connection the command takes), makes its own
copy of the server's memory (:func:`copy_the_heap`) and waits. A command handed over goes
to it, and once no command runs, the next is forked. It takes the command's standard
streams, environment, working folder, arguments and module path, and reads Dask's
configuration again from them; it holds no thread of the server (the server starts none).
The server sends the command's process id, then its exit code (negative: the signal that
ended it); where the command's own process goes away first, the forked one gets SIGTERM,
as a Ctrl-C would end it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
from typing import Any, NoReturn

__all__ = ["CLIENT_NAME", "PREPARED", "compatible", "copy_the_heap", "listen", "serve"]

# In the id of the client each process forked ahead connects (``Client-mgpu-submit-server-...``):
# one waits on the scheduler while no command runs, and the commands handed over use them.
CLIENT_NAME = "mgpu-submit-server"

# What a submit to a running cluster imports, imported once here.
PREPARED = (
    "mgpu.cli",
    "mgpu.api",
    "mgpu.background",
    "mgpu.connection",
    "mgpu.info",
    "mgpu.client.run",
    "mgpu.client.preflight",
    "mgpu.show",
    "mgpu.workloads.dot",
    "mgpu.workloads.matmul",
    "mgpu.workloads.mandelbrot",
    "distributed",
    "distributed.client",
    "tornado.platform.asyncio",
    "rich.console",
    "rich.progress",
    "rich.table",
    "psutil",
)
# madvise(2)'s advice that faults a range's pages in, writable (Linux 5.14).
_MADV_POPULATE_WRITE = 23
# The longest wait for a command's request once it connected.
_READ_S = 5.0


def listen(name: str) -> socket.socket:
    """The server's socket, bound to abstract name ``name`` and listening."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)
    return listener


def prepare() -> None:
    """Import what a submit to a running cluster imports (:data:`PREPARED`), as its client
    imports it: no RMM, no NVML (see ``mgpu.cli._client_only``), no collection meanwhile;
    what is made is frozen, so the forked commands never walk it."""
    import importlib

    gc.disable()
    for name in ("rmm", "pynvml"):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # an import of it raises ImportError
    from .imports import c_yaml

    c_yaml()
    for name in PREPARED:
        importlib.import_module(name)
    import distributed.versions

    from .info import read_versions

    # Read once here, kept by every forked process: what a new client reports to the
    # scheduler (a ``uname -p`` process, the packages' metadata) and what a result records.
    distributed.versions.get_versions()
    read_versions()
    gc.freeze()


def compatible(asked: dict[str, Any], fingerprint: list[int]) -> str | None:
    """Why a command asking ``asked`` would not run here as in its own process, or None:
    another interpreter, another mgpu or mgpu's files changed since the server read them
    (``fingerprint``, :func:`mgpu.handover.fingerprint` then), or another module path (the
    first entry, the command's folder, aside: the forked process takes the command's)."""
    from . import handover

    if asked.get("executable") != sys.executable:
        return f"another interpreter ({asked.get('executable')})"
    if asked.get("package") != handover.__file__:
        return f"another mgpu ({asked.get('package')})"
    if asked.get("fingerprint") != fingerprint:
        return "mgpu's files changed since the server imported them"
    path = asked.get("path")
    if not isinstance(path, list) or path[1:] != sys.path[1:]:
        return "another module path"
    return None


class _Server:
    """The accept loop: a forked command per request, and its exit code to its caller."""

    def __init__(self, listener: socket.socket, fingerprint: list[int]) -> None:
        self.listener = listener
        self.fingerprint = fingerprint  # mgpu's files as the server imported them
        self.running: dict[int, socket.socket] = {}  # forked command's pid -> its caller
        self.address: str | None = None  # the scheduler's, once cluster up's process wrote it
        self.ready: tuple[int, socket.socket] | None = None  # the process forked ahead, and its end of a pipe
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        for end in (self.wake_r, self.wake_w):
            end.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "signal")
        self.selector.register(sys.stdin, selectors.EVENT_READ, "parent")
        signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup is written
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._stop)

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def run(self) -> None:
        while not self.stopping:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    with contextlib.suppress(OSError):
                        self.wake_r.recv(4096)
                    self._reap()
                elif key.data == "parent":
                    said = os.read(sys.stdin.fileno(), 4096)
                    if not said:  # cluster up's process ended
                        self.stopping = True
                    elif self.address is None:
                        self.address = said.decode().strip()
                        self._fork_ahead()
                else:
                    self._caller_left(key.data)
        ahead = [self.ready[0]] if self.ready is not None else []
        for pid in [*self.running, *ahead]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _fork_ahead(self) -> None:
        """Fork the process the next command goes to; it connects to the scheduler meanwhile."""
        ours, theirs = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            self._wait_for_a_command(theirs)
        theirs.close()
        self.ready = (pid, ours)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                raise PermissionError("another user")
            conn.settimeout(_READ_S)
            asked, fds = _read_request(conn)
            why = compatible(asked, self.fingerprint)
            if why is not None or len(fds) != 3:
                conn.sendall((json.dumps({"refused": why or "no standard streams"}) + "\n").encode())
                raise ConnectionRefusedError(why)
            pid = self._hand_on(asked, fds)
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        except (OSError, ValueError):
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        conn.setblocking(False)
        self.running[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _hand_on(self, asked: dict[str, Any], fds: list[int]) -> int:
        """Give the command to the process forked ahead, or where there is none (the
        cluster's address not known yet), to one forked now; returns its pid."""
        if self.ready is not None:
            pid, pipe = self.ready
            self.ready = None
            with pipe:
                _send(pipe, asked, fds)
            return pid
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_the_command(asked, fds)
        return pid

    def _reap(self) -> None:
        """Send each command that ended its exit code; then, once none runs, fork the
        process for the next one (not while one runs: it would take the command's processor
        time, on a host with few cores)."""
        ended = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if self.ready is not None and self.ready[0] == pid:  # ended before any command came
                self.ready[1].close()
                self.ready = None
            conn = self.running.pop(pid, None)
            if conn is None:
                continue
            ended = True
            self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.sendall((json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            conn.close()
        if ended and not self.running and self.ready is None and self.address is not None and not self.stopping:
            self._fork_ahead()

    def _caller_left(self, pid: int) -> None:
        """The caller of ``pid`` closed its connection (or wrote to it): it went away while
        its command ran, which ends as a SIGTERM would end it."""
        conn = self.running.get(pid)
        if conn is None:
            return
        with contextlib.suppress(OSError):
            if conn.recv(1):
                return
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def _leave_the_server(self) -> None:
        """In a forked process: the server's signal handlers and sockets let go of."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        ahead = [self.ready[1]] if self.ready is not None else []
        for sock in (self.listener, self.wake_r, self.wake_w, *self.running.values(), *ahead):
            sock.close()

    def _wait_for_a_command(self, pipe: socket.socket) -> NoReturn:
        """In the process forked ahead: connect to the scheduler, then wait for a command
        (its request and streams, from ``pipe``) and run it. Never returns."""
        try:
            self._leave_the_server()
            # Not the server's pipe from cluster up's process, which is the server's to read;
            # and descriptor 0 stays taken, so that the streams received land above 2.
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            import copy

            import dask.config

            from .connection import ahead

            assert self.address is not None
            ahead(self.address, CLIENT_NAME)  # the connection the command takes (mgpu.connection.take_ahead)
            connected_with = copy.deepcopy(dask.config.config)
            copy_the_heap()  # while it waits, not page by page as the command writes
            asked, fds = _read_request(pipe)
        except BaseException:  # the server went away (or stopped it): nothing to run
            os._exit(0)
        self._become_the_command(asked, fds, connected_with=connected_with)

    def _become_the_command(
        self, asked: dict[str, Any], fds: list[int], *, connected_with: dict[str, Any] | None = None
    ) -> NoReturn:
        """In the forked process: take the command's streams, environment, folder and
        arguments, and run it. ``connected_with``: in the process forked ahead, the Dask
        configuration its connection to the scheduler was made with; where the command's
        differs, the command connects anew, with its own. Never returns."""
        left = connected_with is not None
        code: int | str | None = 1
        try:
            if not left:
                self._leave_the_server()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            _take_streams(asked["streams"])
            os.chdir(asked["cwd"])
            os.environ.clear()
            os.environ.update(asked["env"])
            sys.argv = list(asked["argv"])
            sys.orig_argv = list(asked["orig_argv"])
            if asked["path"]:
                sys.path[0] = asked["path"][0]
            import dask.config

            dask.config.refresh()  # the command's environment and configuration files
            if connected_with is not None and _spelled(dask.config.config) != _spelled(connected_with) and self.address:
                from .connection import forget_ahead

                forget_ahead(self.address)
            from .signals import exit_on_signals_while_starting

            exit_on_signals_while_starting()
            from .cli import main

            main()  # ends the process (mgpu.lifetime.end) once done
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            import traceback

            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The command's request (one line of JSON) and the file descriptors sent with it."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    chunks = [data]
    while data and not chunks[-1].endswith(b"\n"):
        data = conn.recv(1 << 16)
        chunks.append(data)
    asked = json.loads(b"".join(chunks))
    if not isinstance(asked, dict):
        raise ValueError("not a request")
    return asked, fds


def copy_the_heap() -> None:
    """Make this forked process's own copy of the writable memory it shares with the server
    now (Linux's ``MADV_POPULATE_WRITE`` over its private anonymous mappings), rather than a
    page at a time as the command first writes to each: on two cores, a Mandelbrot job's
    plan took 1.3 ms against 0.7 in a process of its own, and its first tile 2-3 ms more,
    until the process forked ahead did this while it waited (50 ms for its 120 MiB there).
    It copies all of it before it takes a command: a command taken halfway would copy the
    rest page by page again. A kernel without it (before 5.14) refuses, and the pages are
    copied as they are written."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()  # address, perms, offset, dev, inode[, path]
            anonymous = len(fields) == 5 or fields[5] == "[heap]"
            if fields[1].startswith("rw") and fields[1][3] == "p" and anonymous:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE)


def _spelled(config: dict[str, Any]) -> dict[str, Any]:
    """Dask's configuration with each key spelled one way: Dask takes ``_`` and ``-`` for one
    another (a key set from the environment before its default is known keeps its ``_``)."""
    return {str(k).replace("_", "-"): _spelled(v) if isinstance(v, dict) else v for k, v in config.items()}


def _send(pipe: socket.socket, asked: dict[str, Any], fds: list[int]) -> None:
    """Send a command's request and its streams down ``pipe``, as the command sent them."""
    data = (json.dumps(asked) + "\n").encode()
    sent = socket.send_fds(pipe, [data], fds)
    pipe.sendall(data[sent:])


def _take_streams(streams: list[list[str | None]]) -> None:
    """Standard streams over descriptors 0-2 (the command's own now), encoded as the
    command's were, buffered as the interpreter buffers them (stdout by line at a
    terminal, stderr always by line). ``sys.__stdout__`` and the others, and the log
    handlers holding them, write to the same descriptors, so to the command's streams too."""
    (in_encoding, in_errors), (out_encoding, out_errors) = streams
    stdout_buffering = 1 if os.isatty(1) else -1
    sys.stdin = open(0, encoding=in_encoding, errors=in_errors, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=stdout_buffering, encoding=out_encoding, errors=out_errors, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding=out_encoding, errors="backslashreplace", closefd=False)  # noqa: SIM115


def serve(name: str) -> None:
    """The server's body: listen at ``name``, import, then fork a command per request until
    SIGTERM or until ``cluster up``'s process (holding this one's standard input) ends."""
    from .handover import fingerprint

    listener = listen(name)
    files = fingerprint()  # before the imports: a file edited meanwhile is not taken for imported
    prepare()
    if threading.active_count() > 1:  # a forked command would hold a copy of a thread's locks
        print(f"mgpu: submit server: {threading.enumerate()} running after its imports", file=sys.stderr)
    _Server(listener, files).run()


if __name__ == "__main__":
    serve(sys.argv[1])
