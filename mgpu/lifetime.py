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
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

__all__ = [
    "COLLECTOR_PRELOAD",
    "dask_setup",
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
