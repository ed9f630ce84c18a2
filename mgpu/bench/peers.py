"""``mgpu bench peers``: mgpu beside the tools a user would otherwise reach for, same
sizes, same devices, same run.

- dask.array ``x @ y`` and ``da.dot``: CuPy chunks on dask-cuda's ``LocalCUDACluster`` over
  TCP and over UCX (NVLink) where there are GPUs, NumPy chunks on a ``LocalCluster`` on CPU;
  inputs persisted first, so only the operation is timed;
- CuPy on one GPU (matmul per dtype, ``cupy.dot``): what one device does alone;
- cuBLASXt's GEMM on host-resident random operands over the same GPUs, in each
  configuration of :mod:`mgpu.bench.xtcases` (pinned operands, its best; pageable with its
  pinning mode; pageable). The same work from files is in ``mgpu bench outofcore``.

The GPU-only alternatives are skipped on CPU with a note saying so.
"""

from __future__ import annotations

from typing import Any

from .harness import Options, resolve, run_child, run_jobs, skipped, summarize

SIZES = {  # matmul side and dask chunk, dot length and dask chunk
    "tiny": {"matmul": 256, "matmul_chunk": 128, "dot": 200_000, "dot_chunk": 50_000, "timeout": 120},
    "small": {"matmul": 8192, "matmul_chunk": 4096, "dot": 200_000_000, "dot_chunk": 50_000_000, "timeout": 300},
    "full": {"matmul": 32768, "matmul_chunk": 8192, "dot": 2_000_000_000, "dot_chunk": 250_000_000, "timeout": 600},
}
# The alternative's figure each mgpu job is set against.
_SAME_WORK = {"matmul-float32": "matmul", "dot-float32": "dot"}


def protocols(opts: Options, backend: str) -> list[str]:
    """``--protocol``, or on GPUs both TCP and UCX (NVLink); CPU workers talk TCP."""
    if opts.protocol != "auto":
        return [opts.protocol]
    return ["tcp", "ucx"] if backend == "cuda" else ["tcp"]


def compare(summary: list[dict[str, Any]], alternatives: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mgpu job and alternative with the same work on the same device count."""
    rows = []
    for row in summary:
        work = _SAME_WORK.get(row["name"])
        for alt_name, per_count in alternatives.items():
            # A record per device count, or one record for one GPU alone (CuPy).
            alt, alt_devices = (
                (per_count, 1) if "status" in per_count else (per_count.get(str(row["devices"])), row["devices"])
            )
            for fig in (alt or {}).get("figures") or []:
                if fig["name"] == work and row["throughput"]:
                    rows.append(
                        {
                            "job": row["name"],
                            "devices": row["devices"],
                            "mgpu": row["throughput"],
                            "alternative": alt_name,
                            "alternative_devices": alt_devices,
                            "config": fig.get("config"),
                            "value": fig["value"],
                            "unit": fig["unit"],
                            "mgpu_over_alternative": row["throughput"] / fig["value"],
                        }
                    )
    return rows


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body)."""
    backend, sizes, counts = resolve(opts)
    s = SIZES[sizes]
    n = s["matmul"]
    jobs = [
        ("matmul-float32", {"workload": "matmul", "params": {"m": n, "n": n, "k": n, "dtype": "float32"}}),
        ("dot-float32", {"workload": "dot", "params": {"n": s["dot"], "dtype": "float32"}}),
    ]
    runs = run_jobs(opts, jobs, backend, counts)
    sized = {"matmul_n": n, "matmul_chunk": s["matmul_chunk"], "dot_n": s["dot"], "dot_chunk": s["dot_chunk"]}
    sized["repeats"] = max(opts.repeats, 3)
    alternatives: dict[str, Any] = {}
    for protocol in protocols(opts, backend):
        alternatives[f"dask-array-{protocol}"] = {
            str(c): run_child(
                opts,
                "dask-array",
                f"dask-array-{protocol}-{c}",
                {**sized, "backend": backend, "devices": c, "protocol": protocol},
                s["timeout"],
            )
            for c in counts
        }
    if backend == "cuda":
        alternatives["cupy-1gpu"] = run_child(opts, "cupy", "cupy-1gpu", sized, s["timeout"])
        alternatives["cublasxt"] = {
            str(c): run_child(opts, "cublasxt", f"cublasxt-{c}", {"n": n, "devices": c}, s["timeout"]) for c in counts
        }
    else:
        alternatives["cupy-1gpu"] = skipped("CuPy needs a GPU; it runs with --backend cuda")
        alternatives["cublasxt"] = skipped("cuBLASXt needs GPUs; it runs with --backend cuda")
    summary = summarize(runs)
    return {"backend": backend, "sizes": sizes, "device_counts": counts}, {
        "runs": runs,
        "alternatives": alternatives,
        "summary": summary,
        "comparison": compare(summary, alternatives),
    }
