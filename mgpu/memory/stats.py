"""Allocator statistics per worker, measured over one job.

A worker plugin (:class:`~mgpu.worker.plugins.AllocatorStats`) puts RMM's
``StatisticsResourceAdaptor`` on top of the worker's resource (dask-cuda's pool, async or
managed resource, and mgpu's spill fallback where there is one), so every allocation CuPy
makes through RMM is counted. The client side opens a window on
each worker before the warm-up (``push_counters``: fresh counters) and closes it after the
last tile (``pop_counters``): the figures are the job's, not the worker's lifetime.

Where CuPy does not allocate through RMM (``allocator: default``), only CuPy's own pool
can be read (its size); on CPU workers nothing is measured. Missing figures stay ``None``
("n/a"), never zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = [
    "Counts",
    "CupyPoolTracker",
    "RmmTracker",
    "describe_chain",
    "cupy_uses_rmm",
    "resource_chain",
    "window_from_snapshots",
    "window_from_stack",
]


@dataclass(frozen=True)
class Counts:
    """RMM's six allocation counters (``rmm.statistics.Statistics``)."""

    current_bytes: int = 0
    current_count: int = 0
    peak_bytes: int = 0
    peak_count: int = 0
    total_bytes: int = 0
    total_count: int = 0

    @classmethod
    def of(cls, stats: Any) -> Counts:
        """From RMM's ``Statistics`` dataclass, or the dict older RMM releases return."""
        get = stats.__getitem__ if isinstance(stats, dict) else stats.__getattribute__
        return cls(**{f.name: int(get(f.name)) for f in fields(cls)})


def window_from_stack(before: Counts, job: Counts) -> Counts:
    """The job's figures from RMM's counter stack.

    ``before`` is what ``push_counters`` returned (the worker's counters at the job's
    start); ``job`` is what ``pop_counters`` returned: counters that started at zero at
    the push, so their current and peak are relative to what was allocated then.
    """
    return Counts(
        current_bytes=before.current_bytes + job.current_bytes,
        current_count=before.current_count + job.current_count,
        peak_bytes=before.current_bytes + job.peak_bytes,
        peak_count=before.current_count + job.peak_count,
        total_bytes=job.total_bytes,
        total_count=job.total_count,
    )


def window_from_snapshots(before: Counts, after: Counts) -> dict[str, int | None]:
    """The job's figures from two snapshots, for an RMM without the counter stack.

    Totals are differences. A peak is the job's only if it rose during the job; otherwise
    the job's own peak is unknown (``None``), as the lifetime peak came before it.
    """
    return {
        "current_bytes": after.current_bytes,
        "current_count": after.current_count,
        "peak_bytes": after.peak_bytes if after.peak_bytes > before.peak_bytes else None,
        "peak_count": after.peak_count if after.peak_count > before.peak_count else None,
        "total_bytes": after.total_bytes - before.total_bytes,
        "total_count": after.total_count - before.total_count,
    }


class RmmTracker:
    """One GPU worker's statistics adaptor, the kind of resource under it, and its pool.

    Parameters
    ----------
    adaptor
        The ``StatisticsResourceAdaptor`` on top of the worker's resource.
    kind
        ``"pool"``, ``"async"``, ``"managed"`` or ``"cuda"`` (RMM straight on cudaMalloc).
    pool
        The ``PoolMemoryResource`` whose ``pool_size()`` is reported, if any.
    limit
        A cap on what the resource may allocate, if one is set.
    """

    def __init__(self, adaptor: Any, kind: str, pool: Any = None, limit: int | None = None) -> None:
        self.adaptor = adaptor
        self.kind, self.pool, self.limit = kind, pool, limit
        self._before: Counts | None = None
        self._pushed = False

    def _read(self) -> Counts:
        counts = getattr(self.adaptor, "allocation_counts", None)  # a property since RMM 24.08
        if counts is None:
            counts = self.adaptor.get_allocation_counts()
        return Counts.of(counts)

    def begin(self) -> None:
        if self._pushed:  # a window left open by a job that failed: close it first
            self.adaptor.pop_counters()
        self._pushed = hasattr(self.adaptor, "push_counters")
        self._before = Counts.of(self.adaptor.push_counters()) if self._pushed else self._read()

    def end(self) -> dict[str, Any]:
        if self._pushed and self._before is not None:  # begin() pushed: _before is set
            job = Counts.of(self.adaptor.pop_counters())
            figures: dict[str, Any] = asdict(window_from_stack(self._before, job))
        elif self._before is not None:
            figures = window_from_snapshots(self._before, self._read())
        else:
            figures = asdict(self._read())  # no window was opened: the worker's lifetime
        self._pushed, self._before = False, None
        pool = self.pool.pool_size() if self.pool is not None else None
        return {"kind": self.kind, "pool_size": pool, "limit": self.limit, **figures}

    def now(self) -> dict[str, Any]:
        """What the resource holds now, whatever window is open: bytes in use, the most in
        use at once over the worker's life, and the pool's size (None without a pool)."""
        counts = self._read()
        if self._pushed and self._before is not None:
            # A job's counters count from its push: what was in use then comes on top.
            before = self._before
            in_use = before.current_bytes + counts.current_bytes
            peak = max(before.peak_bytes, before.current_bytes + counts.peak_bytes)
        else:
            in_use, peak = counts.current_bytes, counts.peak_bytes
        size = self.pool.pool_size() if self.pool is not None else None
        return {"kind": self.kind, "in_use": in_use, "peak": peak, "size": size}


class CupyPoolTracker:
    """``allocator: default``: CuPy's own pool, which counts nothing but its size."""

    def begin(self) -> None:
        pass

    def now(self) -> dict[str, Any]:
        import cupy

        pool = cupy.get_default_memory_pool()
        return {"kind": "default", "in_use": int(pool.used_bytes()), "peak": None, "size": int(pool.total_bytes())}

    def end(self) -> dict[str, Any]:
        import cupy

        pool = cupy.get_default_memory_pool()
        return {"kind": "default", "pool_size": int(pool.total_bytes()), "current_bytes": int(pool.used_bytes())}


def describe_chain(chain: list[Any], mr: Any) -> tuple[str, Any, int | None]:
    """(kind, the ``PoolMemoryResource`` if any, a ``LimitingResourceAdaptor``'s limit if any)
    of a resource chain, top first; ``mr`` is ``rmm.mr``. The topmost known resource names
    the kind: a pool over managed memory is a pool."""
    kinds = (
        (mr.PoolMemoryResource, "pool"),
        (mr.CudaAsyncMemoryResource, "async"),
        (mr.ManagedMemoryResource, "managed"),
        (mr.CudaMemoryResource, "cuda"),
    )
    kind, pool, limit = None, None, None
    for res in chain:
        if limit is None and isinstance(res, mr.LimitingResourceAdaptor):
            limit = int(res.get_allocation_limit())
        for cls, name in kinds:
            if kind is None and isinstance(res, cls):
                kind, pool = name, (res if name == "pool" else None)
    return kind or type(chain[-1]).__name__, pool, limit


def resource_chain(top: Any, fallback: Any = None) -> list[Any]:
    """The resources from ``top`` down to the one that calls CUDA. mgpu's spill fallback
    (a :class:`~mgpu.memory.spill.ManagedFallback`) is an RMM callback resource with no upstream
    RMM knows of, so its primary is followed by hand."""
    chain: list[Any] = []
    res = top
    while res is not None and len(chain) < 16:
        chain.append(res)
        if fallback is not None and res is fallback.resource:
            res = fallback.primary
        else:
            res = getattr(res, "upstream_mr", None)
    return chain


def cupy_uses_rmm() -> bool:
    import cupy

    allocator = cupy.cuda.get_allocator()
    # CuPy's own allocator is a bound method of a Cython class: its __module__ is None.
    return (getattr(allocator, "__module__", None) or "").startswith("rmm")
