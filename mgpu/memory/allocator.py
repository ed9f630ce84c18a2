"""The choices of ``cluster.allocator``, and how a GPU worker's allocator is set up.

A cluster mgpu starts hands the choice to dask-cuda (``LocalCUDACluster``'s RMM options,
which its ``RMMSetup`` worker plugin applies and points CuPy at); spill to managed memory
(:mod:`~mgpu.memory.spill`) and the statistics (:mod:`~mgpu.memory.stats`) are worker
plugins mgpu adds on top of what that made.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["AllocatorChoice", "rmm_options"]


class AllocatorChoice(str, Enum):
    """``cluster.allocator``: how a GPU worker allocates device memory."""

    POOL = "pool"  # an RMM pool of the planner's budget, taken up front
    ASYNC = "async"  # RMM on cudaMallocAsync, the driver's own pool
    MANAGED = "managed"  # RMM on managed (unified) memory
    DEFAULT = "default"  # no RMM: CuPy's own pool

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> list[str]:
        """Every choice as it is written in a job file."""
        return [c.value for c in cls]

    @property
    def can_spill(self) -> bool:
        """Whether ``spill: managed`` can work: it wraps an RMM pool or async resource."""
        return self in (AllocatorChoice.POOL, AllocatorChoice.ASYNC)


def rmm_options(allocator: str, budget: int | float | str, spill: str) -> dict[str, Any]:
    """dask-cuda's RMM options (``LocalCUDACluster`` keywords) for a cluster's allocator.

    Parameters
    ----------
    allocator
        A :class:`AllocatorChoice` value.
    budget
        Each worker's device memory budget: bytes, a fraction of the device or a size string.
    spill
        ``"managed"`` caps the pool (or async resource) at the budget, so allocations past
        it fail over to managed memory; ``"none"`` leaves it uncapped.
    """
    choice = AllocatorChoice(allocator)
    rmm: dict[str, Any] = {}
    if choice is AllocatorChoice.POOL:
        # Take the planner's budget up front: tasks then allocate from the pool at once.
        rmm["rmm_pool_size"] = budget
    elif choice is AllocatorChoice.ASYNC:
        rmm["rmm_async"] = True
    if spill == "managed" and choice.can_spill:
        # The budget is a hard cap: past it, allocations fall back to managed memory.
        rmm["rmm_maximum_pool_size"] = budget
    elif choice is AllocatorChoice.MANAGED:
        rmm["rmm_managed_memory"] = True
    if choice is not AllocatorChoice.DEFAULT:
        rmm["rmm_allocator_external_lib_list"] = ["cupy"]
    return rmm
