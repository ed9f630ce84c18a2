"""A Dask cluster of separate processes (``dask scheduler`` + ``dask worker``), as across
nodes, for the tests that join, kill or interrupt: each process leads its own process group,
torn down by the fixture that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import wait_for
from distributed import Client

# The scheduler and worker CLIs as modules of the interpreter running the tests.
SCHEDULER = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
WORKER = [sys.executable, "-m", "distributed.cli.dask_worker"]

# Popen keywords that start a process as the leader of a new process group (as a shell
# starts a job), so that one killpg reaches it and every process it starts.
OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


@dataclass
class TLSFiles:
    ca: Path
    cert: Path
    key: Path

    def scheduler_args(self) -> list[str]:
        return ["--tls-ca-file", str(self.ca), "--tls-cert", str(self.cert), "--tls-key", str(self.key)]

    def security(self) -> Any:
        from distributed.security import Security

        return Security(
            tls_ca_file=str(self.ca),
            tls_client_cert=str(self.cert),
            tls_client_key=str(self.key),
            require_encryption=True,
        )


@dataclass
class ProcCluster:
    folder: Path
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)
    tls: TLSFiles | None = None

    @property
    def scheduler_file(self) -> Path:
        return self.folder / "scheduler.json"

    @property
    def address(self) -> str:
        import json

        return json.loads(self.scheduler_file.read_text())["address"]

    def client(self, timeout: float = 30) -> Client:
        security = self.tls.security() if self.tls else None
        return Client(scheduler_file=str(self.scheduler_file), security=security, timeout=timeout)

    def processes(self) -> list[subprocess.Popen]:
        return [self.scheduler, *self.workers]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        """Workers first, then the scheduler: SIGTERM to each process group, SIGKILL if it stays."""
        for proc in [*self.workers, self.scheduler]:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    # Anything the group left behind (a nanny's worker) goes too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            **OWN_GROUP,
            cwd=log.parent,
        )


def start_proc_cluster(
    folder: Path,
    n_workers: int = 2,
    *,
    nanny: bool = False,
    tls: TLSFiles | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> ProcCluster:
    """Start ``dask scheduler`` and ``n_workers`` single-threaded ``dask worker`` processes on
    127.0.0.1 (ports chosen by the system), and wait until every worker has joined.

    Worker ``i`` is named ``i`` (mgpu reports a CPU worker's name as its device id).
    """
    folder.mkdir(parents=True, exist_ok=True)
    sched_file = folder / "scheduler.json"
    sched_file.unlink(missing_ok=True)
    security = tls.scheduler_args() if tls else []
    protocol = ["--protocol", "tls"] if tls else []
    # --dashboard-address too: without it the HTTP server (/health) listens on every interface.
    scheduler = _spawn(
        [
            *SCHEDULER,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--dashboard-address",
            "127.0.0.1:0",
            *protocol,
            "--scheduler-file",
            str(sched_file),
            *security,
        ],
        folder / "scheduler.log",
        env,
    )
    cluster = ProcCluster(folder, scheduler, tls=tls)
    try:
        try:
            wait_for(lambda: sched_file.exists() or scheduler.poll() is not None, timeout, "the scheduler file")
        except TimeoutError:
            pass
        if not sched_file.exists():
            raise RuntimeError(f"the scheduler did not start:\n{cluster.logs()}")
        for i in range(n_workers):
            cluster.workers.append(
                _spawn(
                    [
                        *WORKER,
                        "--scheduler-file",
                        str(sched_file),
                        "--host",
                        "127.0.0.1",
                        "--nthreads",
                        "1",
                        "--name",
                        str(i),
                        "--no-dashboard",
                        "--dashboard-address",
                        "127.0.0.1:0",
                        "--nanny" if nanny else "--no-nanny",
                        *security,
                    ],
                    folder / f"worker-{i}.log",
                    env,
                )
            )
        with cluster.client(timeout=timeout) as client:
            client.wait_for_workers(n_workers, timeout=timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def worker_by_name(client: Client, name: str) -> str:
    """The address of the worker called ``name``."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return next(addr for addr, w in workers.items() if str(w.get("name")) == name)


def wait_until_processing(client: Client, worker: str, prefix: str, timeout: float = 60) -> None:
    """Wait until ``worker`` has a task whose key starts with ``prefix`` (a tile is in flight)."""
    wait_for(
        lambda: any(str(k).startswith(prefix) for k in client.processing([worker]).get(worker, ())),
        timeout,
        f"a {prefix} task on {worker}",
    )
