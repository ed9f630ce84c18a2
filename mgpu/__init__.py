"""mgpu: large array jobs on every GPU of a node, or CPU workers, on Dask.

The public API is what this module exports (:func:`run`, :func:`load_job`, :class:`Job`,
:class:`Result`, :class:`Events`, ``config`` and the two errors) and, for a workload
written outside mgpu, the plug-in contract :mod:`mgpu.workload`. Every other module is
internal: its names may change between versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .handover import hand_over_command

hand_over_command()  # the command only: a submit to the cluster ``mgpu cluster up`` started runs in its server

from .lifetime import pause_collection  # noqa: E402

pause_collection()  # the command only: its imports run faster without the collector

from .forkserver import start_for_command  # noqa: E402

start_for_command()  # the command only: a submit's workers import their libraries while it starts

from .signals import exit_on_signals_while_starting  # noqa: E402

exit_on_signals_while_starting()  # the command only: a Ctrl-C during its imports is one line

from .imports import lighter_imports  # noqa: E402

with lighter_imports():  # the command only: Dask's YAML through libyaml, without its notebook templates
    from . import config  # noqa: E402  # registers mgpu.yaml's defaults with Dask, as importing distributed does its own
from .errors import JobFailed, JobInputError  # noqa: E402

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import run
    from .client.watch import Events
    from .results import Result
    from .spec import Job, load_job

__all__ = ["Events", "Job", "JobFailed", "JobInputError", "Result", "__version__", "config", "load_job", "run"]

# The rest is imported when first asked for: ``import mgpu.report`` (reading results)
# must not bring in the client, the cluster and distributed's deployment machinery.
_LAZY = {
    "Events": "mgpu.client.watch",
    "Job": "mgpu.spec",
    "Result": "mgpu.results",
    "load_job": "mgpu.spec",
    "run": "mgpu.api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mgpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
