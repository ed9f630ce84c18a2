"""The worker side of a job, in layers (pyproject.toml's import contracts order them).

:mod:`~mgpu.worker.tasks` holds the entry points of the client's tasks, the only
functions that look the worker's runtime up: they hand its parts down;
:mod:`~mgpu.worker.plugins` holds the worker plugins (the settings, the runtime, the
managed-memory fallback, the allocator statistics); :mod:`~mgpu.worker.runtime` is what
one worker keeps;
:mod:`~mgpu.worker.tile` is the routine around one tile (timing, counters, the check, the
record). Below them: :mod:`~mgpu.worker.device` (the array module, streams, timing),
:mod:`~mgpu.worker.transfer` (staged copies through pinned buffers),
:mod:`~mgpu.worker.panels` (operands kept on a GPU for the job's tiles),
:mod:`~mgpu.worker.exchange` (stepped tiles' edges between GPUs), :mod:`~mgpu.worker.io`
(KvikIO reads and writes), :mod:`~mgpu.worker.sources` (where a tile's operands come from
and its outputs go) and :mod:`~mgpu.worker.kernels` (the array kernels the core runs).
"""
