"""``mgpu bench SUITE``: mgpu's benchmark harness.

Every suite runs mgpu's jobs through the scaling sweep that ``mgpu scale`` runs
(:mod:`mgpu.scale`), or as a user would from a job file (``latency``), runs the
alternatives it sets them against in the same run (each in a child process with a
timeout), and writes one JSON record of one schema into its output folder: the command that ran, the machine, the options, each run's :class:`mgpu.Result`
and a summary. The suites:

``suite``      the device-resident jobs (matmul float32/TF32/float64, dot, Mandelbrot)
``outofcore``  matmul and dot from ``.npy`` files larger than the devices' budget, beside cuBLASXt
``scale``      each job on several device counts (and workers per GPU): throughput and efficiency
``alloc``      allocate + use + free per allocator (``mgpu.memory.bench``)
``peers``      mgpu beside dask.array (on dask-cuda's cluster where there are GPUs),
               CuPy on one GPU and cuBLASXt, at the same sizes
``latency``    what a user waits for each job, cold and on a running cluster, beside a
               plain CuPy (NumPy) script doing the same job on one device
"""

from __future__ import annotations

SUITES = ("suite", "outofcore", "scale", "alloc", "peers", "latency")

__all__ = ["SUITES"]
