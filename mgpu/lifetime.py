"""The ``mgpu`` command's process: no garbage collection while it imports, nor at its exit.

Python's collector runs every few hundred allocations; over the command's imports (Dask,
distributed, NumPy, pydantic: a few hundred thousand objects, none of them garbage) it
walks the ever larger heap again and again, and at exit it walks all of it once more:
on two cores, a third of what a submit to a running cluster spent beyond its job. So the
command collects nothing while it starts; once its cluster is ready, everything made so
far is frozen (never walked again) and collection resumes for what the run makes; and at
exit what is left is frozen too, so the interpreter's last collection has nothing to walk.

Only the command does this: imported as a library (a program, a notebook, a worker
process), mgpu leaves the collector alone.
"""

from __future__ import annotations

import gc
import os
import sys

__all__ = ["finish", "is_command", "pause_collection", "resume_collection"]


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
