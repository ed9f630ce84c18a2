"""A local cluster that outlives one submit: ``mgpu cluster up | status | down``.

``up`` starts a process in a process group of its own that opens the cluster ``mgpu submit``
would start (:func:`mgpu.cluster.open_cluster`: the same workers, allocator, worker setup
and dashboard) and holds it until ``down``. The process records the scheduler's address,
the dashboard and itself in ``cluster.json`` in mgpu's cache folder (``mgpu.cache-dir``);
``submit`` without a scheduler joins the cluster recorded there (:func:`find`).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import config
from .errors import JobFailed, JobInputError
from .spec import ClusterSpec

__all__ = ["Running", "down", "find", "record_path", "up"]

RECORD = "cluster.json"
LOG = "cluster.log"
# What down waits for the cluster to close itself before it ends what is left.
_CLOSE_S = 30.0


@dataclass(frozen=True)
class Running:
    """A cluster ``up`` started, as its record holds it."""

    address: str  # the scheduler's
    dashboard: str | None
    pid: int  # the process that holds the cluster; it leads a process group of its own
    created: float  # that process's start time (psutil), so a reused pid is not taken for it
    backend: str
    workers: int
    log: str
    submit: str | None = None  # the abstract socket its submit server listens at (mgpu.submit_server)
    # Its MPS control daemon, where its workers share GPUs (mgpu.mps): the program and its folder.
    mps: tuple[str, str] | None = None


def record_path() -> Path:
    """Where ``up`` records the cluster: ``cluster.json`` in mgpu's cache folder."""
    return config.load().ceilings_folder() / RECORD


def find() -> Running | None:
    """The cluster ``up`` recorded, if its process still runs; else None (a stale record,
    left by a process that was killed, is removed)."""
    path = record_path()
    try:
        record = json.loads(path.read_text())
        running = Running(**{**record, "mps": tuple(record["mps"]) if record.get("mps") else None})
    except (OSError, ValueError, TypeError):
        return None
    if not _alive(running):
        path.unlink(missing_ok=True)
        return None
    return running


def _alive(running: Running) -> bool:
    import psutil

    try:
        return abs(psutil.Process(running.pid).create_time() - running.created) < 1.0
    except psutil.Error:
        return False


def up(spec: ClusterSpec, timeout: float = 120.0) -> Running:
    """Start the cluster ``spec`` describes in the background and return its record once
    every worker has joined.

    Raises
    ------
    JobInputError
        A cluster is running already, or ``spec`` cannot run on this machine (checked
        before anything starts).
    JobFailed
        The cluster did not start (its log's last lines are in the message) or not
        within ``timeout`` seconds; nothing is left running.
    """
    from .cluster import resolve_cluster

    running = find()
    if running is not None:
        raise JobInputError(
            f"cluster: one is running already at {running.address} (mgpu cluster status); mgpu cluster down stops it"
        )
    if spec.scheduler:
        raise JobInputError("cluster.scheduler: cluster up starts a cluster on this machine; it joins none")
    resolve_cluster(spec)  # every check, before anything starts
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_name(LOG)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mgpu.background", spec.model_dump_json(), str(path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: down ends it and its workers together
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = find()
        if running is not None and running.pid == proc.pid:
            return running
        if proc.poll() is not None:
            raise JobFailed(f"the cluster did not start:\n{_tail(log)}")
        time.sleep(0.1)
    _end_group(proc.pid)
    raise JobFailed(f"the cluster did not start within {timeout:.0f} s:\n{_tail(log)}")


def down(timeout: float = _CLOSE_S) -> Running | None:
    """Stop the running cluster: its process closes the workers and the scheduler; what is
    left of its process group after ``timeout`` seconds is killed. Returns what was
    stopped, or None where nothing ran."""
    running = find()
    if running is None:
        return None
    try:
        os.kill(running.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    _end_group(running.pid, timeout)
    if running.mps is not None:
        from .mps import MpsDaemon

        daemon = MpsDaemon(running.mps[0], Path(running.mps[1]))
        # The cluster's close stops its daemon and removes the folder; a cluster killed
        # leaves both, and the daemon, which detached itself from that process group, outlives it.
        if daemon.folder.exists():
            daemon.stop()
    record_path().unlink(missing_ok=True)
    return running


def _group(pgid: int) -> list[Any]:
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def _end_group(pgid: int, timeout: float = 0.0) -> None:
    """Wait up to ``timeout`` for process group ``pgid`` to end, then kill what is left."""
    import psutil

    _, alive = psutil.wait_procs(_group(pgid), timeout=timeout)
    if alive:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        psutil.wait_procs(alive, timeout=10)


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {log})"


def serve(spec: ClusterSpec, path: Path) -> None:
    """Open the cluster, record it at ``path`` and hold it until SIGTERM or SIGINT; then
    close it and remove the record. The body of the process ``up`` starts."""
    import psutil

    from .cluster import open_cluster, resolve_cluster

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    rc = resolve_cluster(spec)
    submit = f"mgpu-submit-{os.getpid()}-{secrets.token_hex(8)}"
    # Started first: it imports the client side while the cluster starts. It ends when this
    # process does (its standard input, this end of a pipe, closes).
    server = subprocess.Popen([sys.executable, "-m", "mgpu.submit_server", submit], stdin=subprocess.PIPE)
    with server, open_cluster(rc) as info:
        running = Running(
            address=info.client.scheduler.address,
            dashboard=info.dashboard_link,
            pid=os.getpid(),
            created=psutil.Process().create_time(),
            backend=info.backend,
            workers=len(info.devices),
            log=str(path.with_name(LOG)),
            submit=submit,
            mps=(info.mps.program, str(info.mps.folder)) if info.mps is not None else None,
        )
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(running), indent=1))
        os.replace(tmp, path)  # a reader sees the whole record or none
        assert server.stdin is not None
        server.stdin.write(f"{running.address}\n".encode())  # it connects a process to it ahead of a submit
        server.stdin.flush()
        print(f"mgpu: cluster up at {running.address}, {running.workers} worker(s)", flush=True)
        try:
            while not stop.wait(1.0):
                pass
        finally:
            try:
                if json.loads(path.read_text()).get("pid") == os.getpid():
                    path.unlink()
            except (OSError, ValueError):
                pass
    print("mgpu: cluster closed", flush=True)


if __name__ == "__main__":
    serve(ClusterSpec.model_validate_json(sys.argv[1]), Path(sys.argv[2]))
