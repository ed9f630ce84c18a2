"""What a worker imports, imported once by the fork server its processes are forked from
(:mod:`mgpu.forkserver`): distributed, mgpu's worker side and preloads, mgpu's own
workloads, and the GPU libraries where they are installed. Not cupyx (on an H100 host it
imports SciPy's sparse matrices, 0.27 s of the server's 1.35 s), which only the PCIe
ceiling's measurement uses, nor the workloads of installed packages (finding them reads
every package's metadata, 0.07 s): a worker imports those when it needs them.

The server collects no garbage while it imports (there is none, and walking the growing
heap again and again slows the imports, see :mod:`mgpu.lifetime`); what it imported is
frozen, so neither it nor a worker forked from it walks that again.

No import here makes a CUDA context: CuPy, RMM and dask-cuda make theirs when first used,
in each forked worker, with the ``CUDA_VISIBLE_DEVICES`` its nanny gives it. A library
that fails to import is left out: the worker that needs it imports it itself, and fails
there as it would have.
"""

from __future__ import annotations

import contextlib
import gc
import importlib

gc.disable()

from .. import lifetime, signals  # noqa: E402  # the preloads of every worker mgpu starts
from ..workloads import builtin_names, get_workload_class  # noqa: E402
from . import plugins, tasks  # noqa: E402

__all__ = ["GPU_LIBRARIES", "preimport"]

GPU_LIBRARIES = ("cupy", "rmm", "dask_cuda")


def preimport() -> list[str]:
    """Import the GPU libraries and mgpu's workloads; returns the names that imported."""
    done = [m.__name__ for m in (lifetime, signals, plugins, tasks)]
    for name in GPU_LIBRARIES:
        with contextlib.suppress(Exception):
            done.append(importlib.import_module(name).__name__)
    for name in builtin_names():
        with contextlib.suppress(Exception):
            done.append(get_workload_class(name).__module__)
    return done


preimport()
gc.freeze()
gc.enable()
