"""``mgpu bench scale``: each job on several device counts (strong scaling).

Efficiency at N devices is the median throughput at N over N/b times the median at the
fewest devices b: 100% means the work was split with nothing lost.
"""

from __future__ import annotations

import os
from typing import Any

from .harness import Options, gpu_count, resolve, run_jobs, summarize
from .suite import SIZES


def default_counts(have: int) -> list[int]:
    """1, 2, 4, ... up to ``have``, and ``have`` itself."""
    counts, n = [], 1
    while n < have:
        counts.append(n)
        n *= 2
    return [*counts, have]


def efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``efficiency`` to each summary row, against the same job's row at the fewest devices."""
    base: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r["devices"]):
        if row["throughput"] is not None:
            base.setdefault(row["name"], row)
    for row in rows:
        b = base.get(row["name"])
        if b is None or row["throughput"] is None:
            row["efficiency"] = None
        else:
            row["efficiency"] = row["throughput"] / (row["devices"] / b["devices"] * b["throughput"])
    return rows


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body)."""
    if opts.devices is None:
        backend = opts.backend if opts.backend != "auto" else ("cuda" if gpu_count() else "cpu")
        have = gpu_count() if backend == "cuda" else min(os.cpu_count() or 1, 4)
        opts.devices = default_counts(max(have, 1))
    backend, sizes, counts = resolve(opts)
    s = SIZES[sizes]
    n = s["matmul"]
    jobs = [
        ("matmul-float32", {"workload": "matmul", "params": {"m": n, "n": n, "k": n}}),
        ("dot-float32", {"workload": "dot", "params": {"n": s["dot"]}}),
        (
            "mandelbrot-float32",
            {
                "workload": "mandelbrot",
                "params": {
                    "width": s["mandelbrot"],
                    "height": s["mandelbrot"],
                    "max_iter": s["max_iter"],
                    "output": None,
                },
            },
        ),
    ]
    runs = run_jobs(opts, jobs, backend, counts)
    return {"backend": backend, "sizes": sizes, "device_counts": counts}, {
        "runs": runs,
        "summary": efficiency(summarize(runs)),
    }
