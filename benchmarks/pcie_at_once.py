"""Pinned host<->device copy rates of each GPU alone and of all GPUs at once.

    python3 benchmarks/pcie_at_once.py [--gib 4] [--repeat 5] [--json OUT.json]

The out-of-core bound and targets take the PCIe rate as the sum of each GPU's rate
measured alone (2 x 55 GB/s on two H200s). Whether GPUs copying at the same time really
add up depends on how the host links them (one PCIe switch, one root port, memory
bandwidth); this measures it. One thread per GPU, each with its own pinned buffer and
stream; "at once" starts every GPU's copies together and reports each GPU's rate and their
sum over the common wall time.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import click


def _copier(ordinal: int, nbytes: int, repeat: int) -> dict[str, Any]:
    """Buffers on GPU ``ordinal`` and a function timing ``repeat`` copies one way."""
    import cupy

    with cupy.cuda.Device(ordinal):
        host = cupy.cuda.alloc_pinned_memory(nbytes)
        dev = cupy.empty(nbytes, cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)

    def run(kind: str) -> float:
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(ordinal):
            for _ in range(repeat):
                if kind == "h2d":
                    rt.memcpyAsync(dev.data.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr)
                else:
                    rt.memcpyAsync(host.ptr, dev.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
            stream.synchronize()
        return repeat * nbytes

    return {"run": run, "keep": (host, dev, stream)}


def _timed(copiers: list[dict[str, Any]], kind: str) -> tuple[list[float], float]:
    """Every copier's GB/s, all started together, and the wall time until the last ended."""
    barrier = threading.Barrier(len(copiers))
    rates = [0.0] * len(copiers)

    def one(i: int) -> None:
        barrier.wait()
        t = time.perf_counter()
        moved = copiers[i]["run"](kind)
        rates[i] = moved / (time.perf_counter() - t) / 1e9

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(copiers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return rates, time.perf_counter() - t


@click.command()
@click.option("--gib", default=4.0, show_default=True, help="bytes per copy, GiB")
@click.option("--repeat", default=5, show_default=True, help="copies per GPU and direction")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(gib: float, repeat: int, json_path: Path | None) -> None:
    import cupy

    nbytes = int(gib * (1 << 30))
    gpus = cupy.cuda.runtime.getDeviceCount()
    copiers = [_copier(i, nbytes, repeat) for i in range(gpus)]
    for c in copiers:  # the first copies map the buffers: untimed
        c["run"]("h2d")
        c["run"]("d2h")
    report: dict[str, Any] = {"gpus": gpus, "bytes_per_copy": nbytes, "repeat": repeat}
    for kind in ("h2d", "d2h"):
        alone = [_timed([c], kind)[0][0] for c in copiers]
        together, wall = _timed(copiers, kind)
        report[kind] = {
            "alone_gbps": alone,
            "at_once_gbps": together,
            "at_once_sum_gbps": gpus * repeat * nbytes / wall / 1e9,
            "sum_alone_gbps": sum(alone),
        }
        print(
            f"{kind}: alone {', '.join(f'{r:.1f}' for r in alone)} GB/s (sum {sum(alone):.1f}); "
            f"at once {', '.join(f'{r:.1f}' for r in together)} GB/s, "
            f"together {report[kind]['at_once_sum_gbps']:.1f} GB/s"
        )
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
