"""Device memory on the workers, in one place.

- :mod:`~mgpu.memory.allocator`: the choices of ``cluster.allocator`` and how each is set
  up on GPU workers (dask-cuda's RMM options);
- :mod:`~mgpu.memory.spill`: spill to managed memory when an allocation fails;
- :mod:`~mgpu.memory.stats`: the allocator's statistics per worker over one job;
- :mod:`~mgpu.memory.bench`: ``mgpu bench alloc``, what one allocation costs per allocator.

GPU libraries are imported inside functions and ``WorkerPlugin.setup`` only.
"""

from __future__ import annotations

from .allocator import AllocatorChoice, rmm_options

__all__ = ["AllocatorChoice", "rmm_options"]
