"""How fast mgpu's staged reads (mgpu.transfer) move a file in the page cache to the GPU,
alone in a process and inside Dask GPU workers, all of them reading at once.

    python3 benchmarks/stager_probe.py SCRATCH_DIR [--gib 4] [--json OUT.json]

For 8 and 16 host threads: a fresh mapping of a float32 ``.npy`` (every page faults in,
as in a job) loaded whole (a 1-D read, as dot's) and as a column half (a strided 2-D
read, as a B panel), GB/s by the wall clock up to the data's arrival. Then the same in
each worker of a LocalCUDACluster over every visible GPU, the workers reading at once
(their own files); the gap between the two says what the worker's surroundings cost.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
import numpy as np


def _make(path: Path, gib: float) -> None:
    cols = 16384
    rows = int(gib * (1 << 30)) // (4 * cols)
    mm = np.lib.format.open_memmap(str(path), mode="w+", dtype=np.float32, shape=(rows, cols))
    for r in range(0, rows, 4096):
        mm[r : r + 4096] = np.float32(r)
    mm.flush()


def probe(path: str) -> dict[str, float]:
    """GB/s of Stager loads from fresh mappings of ``path``, per thread count and shape."""
    import cupy
    import dask.config

    from mgpu import transfer
    from mgpu.device import Device, DeviceFacts

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    out: dict[str, float] = {}
    for threads in (8, 16):
        with dask.config.set({"mgpu.transfer.host-threads": threads}):
            transfer._POOL = None  # a pool of this size
            for shape in ("flat", "colhalf"):
                for attempt in range(2):  # the first also makes the pinned buffers
                    mm = np.load(path, mmap_mode="r")
                    src = mm.reshape(-1) if shape == "flat" else mm[:, : mm.shape[1] // 2]
                    dst = cupy.empty(src.shape, src.dtype)
                    t = time.perf_counter()
                    transfer.Stager(dev).load(dst, src)
                    dev.stream.synchronize()
                    out[f"stager_{shape}_{threads}t_gbps"] = src.nbytes / (time.perf_counter() - t) / 1e9
                    del dst, mm, src
    return out


@click.command()
@click.argument("scratch", type=click.Path(file_okay=False, path_type=Path))
@click.option("--gib", default=4.0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(scratch: Path, gib: float, json_path: Path | None) -> None:
    import cupy
    from dask.distributed import Client
    from dask_cuda import LocalCUDACluster

    scratch.mkdir(parents=True, exist_ok=True)
    gpus = cupy.cuda.runtime.getDeviceCount()
    paths = [scratch / f"stager-{i}.npy" for i in range(gpus)]
    for p in paths:
        _make(p, gib)
    report: dict[str, Any] = {"gib": gib, "gpus": gpus, "alone": probe(str(paths[0]))}
    with (
        LocalCUDACluster(n_workers=gpus, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        workers = sorted(client.scheduler_info()["workers"])
        futures = [client.submit(probe, str(p), workers=[w], pure=False) for p, w in zip(paths, workers)]
        report["in_workers_at_once"] = client.gather(futures)
    for p in paths:
        p.unlink()
    print(json.dumps(report, indent=1))
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
