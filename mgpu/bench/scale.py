"""``mgpu bench scale``: each job on several device counts (strong scaling), and on several
workers per GPU.

Efficiency at N devices is the median throughput at N over N/b times the median at the
fewest devices b, as ``mgpu scale`` and ``mgpu report`` reckon it: 100% means the work was
split with nothing lost; a job run on one device count alone has none. With
``--workers-per-device W`` every device count also runs with 2, 4, ... W workers sharing
each GPU, the jobs of each layout one after another on one cluster: what does not depend
on having more GPUs (the job's tiles spread over W workers, their exchanges within the
device, the per-job overhead) measured on the GPUs at hand. Each row then says its
``compute_s`` over that of one worker per device.
"""

from __future__ import annotations

from typing import Any

from mgpu.report import efficiency
from mgpu.scale import counts_up_to, default_counts

from .harness import BenchInputError, Options, gpu_count, resolve, run_jobs, say, summarize
from .suite import SIZES, job_files


def with_scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``efficiency`` to each summary row, against the same job's row at the fewest
    devices with as many workers per device (:func:`mgpu.report.efficiency`); and
    ``compute_vs_one_worker``, its ``compute_s`` over the same job's on as many devices
    with one worker each."""
    effs = efficiency(rows, lambda r: (r["name"], r.get("workers_per_device", 1)), lambda r: r["throughput"])
    alone = {(r["name"], r["devices"]): r for r in rows if r.get("workers_per_device", 1) == 1 and r.get("compute_s")}
    for row, eff in zip(rows, effs, strict=True):
        row["efficiency"] = eff
        one = alone.get((row["name"], row["devices"]))
        row["compute_vs_one_worker"] = (
            row["compute_s"] / one["compute_s"] if one is not None and row.get("compute_s") else None
        )
    return rows


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body).

    Raises
    ------
    BenchInputError
        ``--workers-per-device`` on CPU workers (which are one per core already).
    """
    if opts.devices is None:
        backend = opts.backend if opts.backend != "auto" else ("cuda" if gpu_count() else "cpu")
        opts.devices = default_counts(backend, most=None if backend == "cuda" else 4)
    backend, sizes, counts = resolve(opts)
    most = int(opts.extra.get("workers_per_device") or 1)
    if most > 1 and backend != "cuda":
        raise BenchInputError(
            "--workers-per-device: several workers per device is for GPUs; CPU workers are one per core"
        )
    workers = counts_up_to(most)
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
        *job_files(opts.extra.get("jobs") or []),
    ]
    runs = run_jobs(opts, jobs, backend, counts, workers, one_cluster=most > 1)
    summary = with_scaling(summarize(runs))
    for row in summary:
        if row.get("workers_per_device", 1) > 1:
            ratio = row["compute_vs_one_worker"]
            say(
                f"{row['name']} on {row['devices']} device(s), {row['workers_per_device']} workers each: "
                f"compute_s {row['compute_s'] or float('nan'):.4g} s"
                + (f" ({ratio:.3f}x one worker's)" if ratio else "")
                + (f", per-job overhead {row['overhead_s']:.3g} s" if row.get("overhead_s") is not None else "")
            )
    return {"backend": backend, "sizes": sizes, "device_counts": counts, "workers_per_device": workers}, {
        "runs": runs,
        "summary": summary,
    }
