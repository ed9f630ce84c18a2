"""Worker processes forked from a server that imported their libraries while the command started.

A worker process that a nanny spawns starts a new interpreter and imports distributed,
mgpu's worker side and, on GPU workers, CuPy, RMM and dask-cuda before it can join: on an
H100 host 1.2-1.3 s of a fresh cluster's 1.4 s start, after the command's own imports.
So an ``mgpu submit`` that may start its own cluster (no ``--scheduler``) starts
multiprocessing's fork server first thing (:func:`start_for_command`, from ``import
mgpu``), and the server imports all of that (:mod:`mgpu.worker.preimport`) while the
command imports and checks its jobs. The cluster's nannies then fork their workers from it
(:func:`forking`): each starts with its imports done. None of them makes a CUDA context,
so a forked GPU worker makes its own as a spawned one does.

A nanny sets ``distributed.nanny.pre-spawn-environ`` (thread counts, malloc's trim
threshold) in its own process before it spawns, so that the worker starts with them: the
server is started with them instead, and where the configuration asks for others than the
server has, the workers are spawned as usual. A submit that will join the cluster ``mgpu
cluster up`` started does not start the server; one that joins another stops it (:func:`stop`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["PRE_SPAWN_ENVIRON", "forking", "start", "start_for_command", "started", "stop"]

# distributed's defaults of distributed.nanny.pre-spawn-environ, known here without
# importing Dask (which would hold the server back by the time of that import).
PRE_SPAWN_ENVIRON = {
    "MALLOC_TRIM_THRESHOLD_": "65536",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
# What the server imports before it forks anything.
PREIMPORT = "mgpu.worker.preimport"
# Options of submit after which it starts no cluster of its own.
_JOINS = ("--scheduler", "--scheduler-file", "--dry-run", "--help", "-h")


def _server() -> Any:
    from multiprocessing import forkserver

    return forkserver._forkserver


def started() -> bool:
    """Whether this process runs the fork server :func:`start` started."""
    server = _server()
    return getattr(server, "_forkserver_pid", None) is not None and server._preload_modules == [PREIMPORT]


def start() -> None:
    """Start the fork server, importing :data:`PREIMPORT` with :data:`PRE_SPAWN_ENVIRON`
    in its environment (this process's own environment is left as it was)."""
    import atexit
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([PREIMPORT])
    before = {k: os.environ.get(k) for k in PRE_SPAWN_ENVIRON}
    os.environ.update(PRE_SPAWN_ENVIRON)
    try:
        _server().ensure_running()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # At exit, even one still importing (a job refused at once): a server left alone
    # would end only once its imports were done.
    atexit.register(stop)


def start_for_command(argv: list[str] | None = None) -> bool:
    """In the ``mgpu`` command, a ``submit`` that may start its own cluster: start the
    fork server. Returns whether it did."""
    from .handover import recorded
    from .lifetime import is_command

    args = sys.argv[1:] if argv is None else argv
    if not is_command() or args[:1] != ["submit"] or any(a.split("=")[0] in _JOINS for a in args):
        return False
    if "--own-cluster" not in args and recorded() is not None:
        return False
    start()
    return True


def stop() -> None:
    """End the fork server this process started, if any (it may still be importing)."""
    if not started():
        return
    server = _server()
    with contextlib.suppress(OSError):
        os.kill(server._forkserver_pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        server._stop()  # closes its pipes and reaps it; returns at once, the server killed


@contextlib.contextmanager
def forking() -> Iterator[bool]:
    """Inside, the nannies that start fork their workers from the server this process
    started, where it did and the pre-spawn environment asked for is what the server has;
    else they spawn them as usual. Yields whether they fork."""
    import dask.config

    asked = dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {}
    if not started() or {k: str(v) for k, v in asked.items()} != PRE_SPAWN_ENVIRON:
        yield False
        return
    import distributed.utils

    # distributed would otherwise import every package it knows of into this process, to
    # preload them into a server it starts itself; the server running has what it needs.
    distributed.utils._forkserver_preload_set = True
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        yield True
