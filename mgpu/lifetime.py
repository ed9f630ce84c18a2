"""No garbage collection while a process of mgpu's imports and starts, nor at its exit.

Python's collector runs every few hundred allocations; over a start's imports (Dask,
distributed, NumPy, pydantic, on GPU workers CuPy and RMM: a few hundred thousand
objects, none of them garbage) it walks the ever larger heap again and again, and at exit
it walks all of it once more: on two cores, a third of what a submit to a running cluster
spent beyond its job. So:

- the ``mgpu`` command collects nothing while it starts; once its cluster is ready,
  everything made so far is frozen (never walked again) and collection resumes for what
  the run makes; at exit what is left is frozen too, so the interpreter's last collection
  has nothing to walk;
- a worker process of a cluster mgpu starts (this module is one of its preloads) collects
  nothing until its runtime is made (:class:`mgpu.worker.plugins.RuntimeSetup`), then
  freezes what its start made and collects again.

Imported as a library (a program, a notebook, a worker of a cluster mgpu joins), mgpu
leaves the collector alone.

Once its work is done, its files written and closed, the command ends at once
(:func:`end`): the interpreter's teardown (Dask's exit handlers, module finalization)
would only spend tens of milliseconds closing what mgpu closed already.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
from typing import Any, NoReturn

__all__ = [
    "COLLECTOR_PRELOAD",
    "dask_setup",
    "end",
    "finish",
    "is_command",
    "pause_collection",
    "resume_collection",
    "resume_in_worker",
]

# Passed as ``preload`` to the workers of clusters mgpu starts; see dask_setup.
COLLECTOR_PRELOAD = __name__


def is_command() -> bool:
    """Whether this process is the ``mgpu`` command (``python -m mgpu`` or the ``mgpu``
    script), not a program importing mgpu.

    It reads the interpreter's own arguments: a worker process that multiprocessing spawns
    is given the parent's ``sys.argv``, but not its ``orig_argv``.
    """
    argv = sys.orig_argv
    as_module = any(a == "-m" and b == "mgpu" for a, b in zip(argv, argv[1:], strict=False))
    as_script = any(os.path.basename(a) == "mgpu" for a in argv[1:2])
    return as_module or as_script


def pause_collection() -> None:
    """In the command, from its first import: collect nothing until :func:`resume_collection`."""
    if is_command():
        gc.disable()


def resume_collection() -> None:
    """In the command, once its imports are done: freeze what its start made and collect
    again (once; later calls, and calls outside the command, do nothing)."""
    if is_command() and not gc.isenabled():
        gc.freeze()
        gc.enable()


def finish() -> None:
    """Before the command exits: freeze what is left, so the interpreter's last collection
    walks nothing (the process ends; its memory goes with it)."""
    if is_command():
        gc.freeze()


def end(code: int | str | None) -> NoReturn:
    """End the command with ``code`` (as ``sys.exit`` takes it) once its work is done.

    In the command, with its output flushed, the process ends at once (``os._exit``),
    unless something the ordinary exit waits for or closes is still there: a thread that
    is no daemon, a child process, a Dask cluster or client still open. Elsewhere (a
    program calling mgpu's command line), and in those cases, it is ``sys.exit(code)``.
    """
    if not (is_command() and _nothing_left_open()):
        sys.exit(code)
    if not isinstance(code, int):  # as the interpreter ends on SystemExit("message") or SystemExit(None)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    server = sys.modules.get("mgpu.forkserver")
    if server is not None:
        server.stop()  # as its exit handler would: one still importing would go on until done
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        # What an ordinary exit finalizes first: a nanny's queues' named semaphores, which
        # multiprocessing's resource tracker would otherwise report leaked on stderr.
        util._run_finalizers(0)
    logging.shutdown()  # flushes every log handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def _nothing_left_open() -> bool:
    """Whether the interpreter's own exit has nothing to wait for or close: no thread that
    is no daemon but the main one, no child process, no Dask cluster or client open."""
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        return False
    if "multiprocessing" in sys.modules and sys.modules["multiprocessing"].active_children():
        return False
    spec = sys.modules.get("distributed.deploy.spec")
    if spec is not None and len(spec.SpecCluster._instances):
        return False
    client = sys.modules.get("distributed.client")
    return client is None or all(c.status == "closed" for c in list(client.Client._instances))


def dask_setup(worker: Any) -> None:
    """Preload of a worker process of a cluster mgpu starts: collect nothing while it
    sets up (its GPU libraries, its pool, mgpu's plugins) until :func:`resume_in_worker`."""
    gc.disable()


def resume_in_worker(worker: Any) -> None:
    """In a worker started with this module as a preload, once its runtime is made: freeze
    what its start made and collect again (elsewhere, and later, nothing)."""
    preloads = getattr(worker, "preloads", None) or ()
    if not gc.isenabled() and any(getattr(p, "name", None) == COLLECTOR_PRELOAD for p in preloads):
        gc.freeze()
        gc.enable()
