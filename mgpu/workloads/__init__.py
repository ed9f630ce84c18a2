"""The workload registry: a name in the job file -> a Workload class.

mgpu's own workloads are registered here; others come from installed packages through
the ``mgpu.workloads`` entry-point group (loaded by name only, never from a path).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Workload

__all__ = ["ENTRY_POINT_GROUP", "builtin_names", "get_workload_class", "workload_names"]

ENTRY_POINT_GROUP = "mgpu.workloads"

_BUILTIN = {
    "dot": "mgpu.workloads.dot:Dot",
    "mandelbrot": "mgpu.workloads.mandelbrot:Mandelbrot",
    "matmul": "mgpu.workloads.matmul:Matmul",
}


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in _BUILTIN}


def builtin_names() -> list[str]:
    """mgpu's own workloads, sorted (no installed package is looked at)."""
    return sorted(_BUILTIN)


def workload_names() -> list[str]:
    """Every workload a job file may name, sorted."""
    return sorted({*_BUILTIN, *_plugins()})


def get_workload_class(name: str) -> type[Workload]:
    """The Workload class registered under ``name``.

    Raises
    ------
    KeyError
        If no workload has that name.
    """
    if name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    plugins = _plugins()
    if name in plugins:
        return plugins[name].load()  # type: ignore[attr-defined]
    raise KeyError(name)
