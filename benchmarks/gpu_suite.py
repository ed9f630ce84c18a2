"""One GPU-machine run: single-GPU ceilings, then mgpu's jobs, ratios taken in the same run.

    python3 benchmarks/gpu_suite.py OUTDIR [--quick]

Writes OUTDIR/bench.json (every figure, the commands, the device line) and prints a table.
The ceilings are what one GPU does alone with plain CuPy (and mgpu's own kernels); a job's
ratio is its throughput over that ceiling times the devices it used.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers import _event_median  # noqa: E402  (benchmarks/ is the script's own folder)

from mgpu import kernels  # noqa: E402
from mgpu.workloads.mandelbrot import mandelbrot_axes, mandelbrot_counts  # noqa: E402


def _median_seconds(fn, warmup: int = 2, repeat: int = 5) -> tuple[float, list[float]]:
    return _event_median(cupy, fn, warmup, repeat)


def ceilings(quick: bool) -> dict:
    from cupy._core import _routines_linalg as linalg

    out = {}
    n = 8192 if quick else 16384
    for dtype, tf32 in (("float32", False), ("float64", False), ("float32", True)):
        a = kernels.random_block(cupy, seed=0, operand=0, rows=(0, n), cols=(0, n), total_cols=n, dtype=dtype)
        b = kernels.random_block(cupy, seed=0, operand=1, rows=(0, n), cols=(0, n), total_cols=n, dtype=dtype)
        prev = linalg.get_compute_type(np.float32)
        if tf32:
            linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
        t, s = _median_seconds(lambda a=a, b=b: cupy.matmul(a, b))
        linalg.set_compute_type(np.float32, prev)
        out[f"gemm_{'tf32' if tf32 else dtype}_tflops"] = 2 * n**3 / t / 1e12
        del a, b
    nbytes = (1 << 30) if quick else (4 << 30)
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    t, _ = _median_seconds(lambda dst=dst, src=src: dst.__setitem__(slice(None), src))
    out["copy_gbps"] = 2 * nbytes / t / 1e9
    del dst
    m = 250_000_000 if quick else 1_000_000_000
    x = kernels.random_block(cupy, seed=0, operand=0, rows=(0, 1), cols=(0, m), total_cols=m, dtype="float32").ravel()
    y = kernels.random_block(cupy, seed=0, operand=1, rows=(0, 1), cols=(0, m), total_cols=m, dtype="float32").ravel()
    t, _ = _median_seconds(lambda x=x, y=y: cupy.dot(x, y))
    out["cupy_dot_gbps"] = 8 * m / t / 1e9
    t, _ = _median_seconds(lambda x=x, y=y: kernels.dot_f64(cupy, x, y))
    out["mgpu_dot_kernel_gbps"] = 8 * m / t / 1e9
    # Peer copy GPU0 -> GPU1 with peer access (what a tile move over NVLink can reach).
    if cupy.cuda.runtime.getDeviceCount() > 1 and cupy.cuda.runtime.deviceCanAccessPeer(0, 1):
        from mgpu.panels import enable_peer_access

        enable_peer_access(1)
        with cupy.cuda.Device(1):
            dst1 = cupy.empty(x.nbytes, dtype=cupy.uint8)
        t, _ = _median_seconds(
            lambda dst1=dst1, x=x: cupy.cuda.runtime.memcpyPeerAsync(
                dst1.data.ptr, 1, x.data.ptr, 0, x.nbytes, cupy.cuda.get_current_stream().ptr
            )
        )
        out["peer_gbps"] = x.nbytes / t / 1e9
        del dst1
    del x, y, src
    side = 4096 if quick else 16384
    for dtype in ("float32", "float64"):
        xs, ys = mandelbrot_axes(width=side, height=side, bounds=(-2.5, 1.0, -1.25, 1.25), rows=(0, side), dtype=dtype)
        xd, yd = cupy.asarray(xs), cupy.asarray(ys)
        counts = mandelbrot_counts(cupy, xd, yd, 1000)
        iters = float(counts.sum(dtype=np.int64))
        t, _ = _median_seconds(lambda xd=xd, yd=yd: mandelbrot_counts(cupy, xd, yd, 1000), repeat=3)
        out[f"mandelbrot_{dtype}_giters"] = iters / t / 1e9
    cupy.get_default_memory_pool().free_all_blocks()
    return out


JOBS_FULL = [
    # label, job, devices, overrides, ceiling key
    (
        "matmul-32k-f32-pool",
        "jobs/matmul.yaml",
        "0,1",
        ["params.m=32768", "params.n=32768", "params.k=32768"],
        "gemm_float32_tflops",
        ["--allocator", "pool"],
    ),
    (
        "matmul-32k-f32-async",
        "jobs/matmul.yaml",
        "0,1",
        ["params.m=32768", "params.n=32768", "params.k=32768"],
        "gemm_float32_tflops",
        ["--allocator", "async"],
    ),
    (
        "matmul-32k-f32-1gpu",
        "jobs/matmul.yaml",
        "1",
        ["params.m=32768", "params.n=32768", "params.k=32768"],
        "gemm_float32_tflops",
        [],
    ),
    (
        "matmul-32k-tf32",
        "jobs/matmul.yaml",
        "0,1",
        ["params.m=32768", "params.n=32768", "params.k=32768", "params.precision=tf32"],
        "gemm_tf32_tflops",
        [],
    ),
    (
        "matmul-32k-f64",
        "jobs/matmul.yaml",
        "0,1",
        ["params.m=32768", "params.n=32768", "params.k=32768", "params.dtype=float64"],
        "gemm_float64_tflops",
        [],
    ),
    (
        "matmul-32k-f32-distributed",
        "jobs/matmul.yaml",
        "0,1",
        ["params.m=32768", "params.n=32768", "params.k=32768", "params.operands=distributed"],
        "gemm_float32_tflops",
        [],
    ),
    (
        "matmul-32k-tf32-distributed",
        "jobs/matmul.yaml",
        "0,1",
        ["params.m=32768", "params.n=32768", "params.k=32768", "params.precision=tf32", "params.operands=distributed"],
        "gemm_tf32_tflops",
        [],
    ),
    (
        "matmul-32k-tf32-1gpu",
        "jobs/matmul.yaml",
        "1",
        ["params.m=32768", "params.n=32768", "params.k=32768", "params.precision=tf32"],
        "gemm_tf32_tflops",
        [],
    ),
    (
        "matmul-32k-f64-1gpu",
        "jobs/matmul.yaml",
        "1",
        ["params.m=32768", "params.n=32768", "params.k=32768", "params.dtype=float64"],
        "gemm_float64_tflops",
        [],
    ),
    ("dot-2g-f32", "jobs/dot.yaml", "0,1", ["params.n=2000000000"], "copy_gbps", []),
    ("dot-20g-f32", "jobs/dot.yaml", "0,1", ["params.n=20000000000"], "copy_gbps", []),
    ("dot-2g-f32-1gpu", "jobs/dot.yaml", "1", ["params.n=2000000000"], "copy_gbps", []),
    (
        "mandelbrot-64k-f32",
        "jobs/mandelbrot.yaml",
        "0,1",
        ["params.width=65536", "params.height=65536", "params.max_iter=1000", "params.output=null"],
        "mandelbrot_float32_giters",
        [],
    ),
    (
        "mandelbrot-64k-f32-1gpu",
        "jobs/mandelbrot.yaml",
        "1",
        ["params.width=65536", "params.height=65536", "params.max_iter=1000", "params.output=null"],
        "mandelbrot_float32_giters",
        [],
    ),
    (
        "mandelbrot-64k-f64",
        "jobs/mandelbrot.yaml",
        "0,1",
        [
            "params.width=65536",
            "params.height=65536",
            "params.max_iter=1000",
            "params.output=null",
            "params.dtype=float64",
        ],
        "mandelbrot_float64_giters",
        [],
    ),
    (
        "mandelbrot-64k-f64-1gpu",
        "jobs/mandelbrot.yaml",
        "1",
        [
            "params.width=65536",
            "params.height=65536",
            "params.max_iter=1000",
            "params.output=null",
            "params.dtype=float64",
        ],
        "mandelbrot_float64_giters",
        [],
    ),
]


def _quick(jobs):
    small = {"32768": "8192", "2000000000": "200000000", "20000000000": "400000000", "65536": "8192"}
    out = []
    for label, job, devs, sets, key, extra in jobs:
        sets = [s.split("=")[0] + "=" + small.get(s.split("=")[1], s.split("=")[1]) for s in sets]
        out.append((label.replace("32k", "8k").replace("2g", "200m").replace("64k", "8k"), job, devs, sets, key, extra))
    return out


def main() -> None:
    outdir = Path(sys.argv[1])
    # Each job's own JSON lands in OUTDIR/jobs/; bench.json holds them all as well.
    quick = "--quick" in sys.argv
    outdir.mkdir(parents=True, exist_ok=True)
    device_line = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    report = {
        "device": device_line,
        "argv": sys.argv,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cupy": cupy.__version__,
    }
    report["ceilings"] = ceil = ceilings(quick)
    print("ceilings (one GPU):", json.dumps(ceil, indent=1), flush=True)
    rows = []
    for label, job, devs, sets, key, extra in _quick(JOBS_FULL) if quick else JOBS_FULL:
        out = outdir / "jobs" / f"{label}.json"
        out.parent.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "mgpu",
            "submit",
            job,
            "--devices",
            devs,
            "--no-dashboard",
            "-q",
            "--json",
            str(out),
            *extra,
        ]
        for s in sets:
            cmd += ["--set", s]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        elapsed = time.perf_counter() - t0
        row = {"label": label, "cmd": " ".join(cmd[1:]), "rc": proc.returncode, "process_s": elapsed}
        if proc.returncode != 0 or not out.exists():
            row["stderr"] = proc.stderr[-3000:]
            print(f"{label}: FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            rows.append(row)
            continue
        r = json.loads(out.read_text())
        ndev = len(r["per_device"])
        busy = max(d["busy_s"] for d in r["per_device"])
        thr = r["throughput"]["value"]
        work = thr * r["compute_s"]
        row.update(
            devices=ndev,
            status=r["status"],
            verify=r["verify"],
            throughput=thr,
            unit=r["throughput"]["unit"],
            compute_s=r["compute_s"],
            wall_s=r["wall_s"],
            kernel_throughput=work / busy if busy else None,
            ceiling=ceil[key] * ndev,
            ratio=thr / (ceil[key] * ndev),
            kernel_ratio=(work / busy) / (ceil[key] * ndev) if busy else None,
            value=r["value"],
            result=r,
            roofline=r.get("roofline"),
        )
        rows.append(row)
        moved = [(d["id"], d["bytes_d2d"], d.get("d2d_gbps")) for d in r["per_device"] if d.get("bytes_d2d")]
        if moved:
            print(f"{label}: peer copies (device, bytes, GB/s): {moved}", flush=True)
        print(
            f"{label}: {thr:.4g} {row['unit']} ({row['ratio']:.1%} of {ndev}x ceiling), kernel-only {row['kernel_ratio']:.1%}, "
            f"compute {r['compute_s']:.3f}s wall {r['wall_s']:.2f}s verify {r['verify']['passed']} err {r['verify']['max_rel_error']}",
            flush=True,
        )
    report["jobs"] = rows
    (outdir / "bench.json").write_text(json.dumps(report, indent=2))
    print(
        "\n{:<26} {:>4} {:>12} {:>9} {:>8} {:>8} {:>8} {:>7}".format(
            "job", "dev", "throughput", "unit", "ratio", "kernel", "roofline", "wall"
        )
    )
    for r in rows:
        if "throughput" in r:
            roof = (r.get("roofline") or {}).get("fraction") or 0
            print(
                "{:<26} {:>4d} {:>12.4g} {:>9} {:>7.1f}% {:>7.1f}% {:>7.1f}% {:>6.1f}s".format(
                    r["label"],
                    r["devices"],
                    r["throughput"],
                    r["unit"],
                    100 * r["ratio"],
                    100 * (r["kernel_ratio"] or 0),
                    100 * roof,
                    r["wall_s"],
                )
            )
        else:
            print("{:<26} FAILED".format(r["label"]))


if __name__ == "__main__":
    main()
