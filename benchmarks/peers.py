"""mgpu against its peers on the same GPUs, at the same sizes, in one run.

    python3 benchmarks/peers.py OUTDIR [--quick] [--only STEP,...] [--budget SECONDS]

Each step runs in its own process (a fresh cluster or CUDA context, killed on its
timeout) so that one failure, UCX included, costs only its own figures:

- ``cupy``: plain CuPy on one GPU: each GPU's cuBLAS GEMM rate (float32, float64, TF32)
  and device copy bandwidth (the ceilings), matmul at the job size, ``cupy.dot``;
- ``mgpu-*``: ``python -m mgpu submit`` of the matching job files;
- ``dask-array-tcp`` / ``dask-array-ucx``: dask.array + CuPy on a LocalCUDACluster
  (2 workers, RMM pool), matmul with chunks 8192 and a 1-D dot;
- ``local-cupy-ucx`` / ``local-cupy-tcp``: dask-cuda's own
  ``python -m dask_cuda.benchmarks.local_cupy -o dot -s 40000 -c 10000``.

Prints one line per step and a table (figure, share of the two GPUs' summed single-GPU
ceiling, mgpu/peer ratio), and writes OUTDIR/peers.json with every figure, raw samples,
the commands, ``nvidia-smi -L`` and versions; logs of each step land in OUTDIR/logs/.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
DEVICES = "0,1"

SIZES: dict[str, dict[str, int]] = {
    "full": {
        "ceil_n": 16384,
        "copy_bytes": 4 << 30,
        "mm_n": 32768,
        "mm_chunk": 8192,
        "cupy_dot_n": 1_000_000_000,
        "dot_n": 2_000_000_000,
        "dot_chunk": 250_000_000,
        "lc_size": 40000,
        "lc_chunk": 10000,
    },
    "quick": {
        "ceil_n": 4096,
        "copy_bytes": 1 << 30,
        "mm_n": 8192,
        "mm_chunk": 2048,
        "cupy_dot_n": 100_000_000,
        "dot_n": 200_000_000,
        "dot_chunk": 25_000_000,
        "lc_size": 10000,
        "lc_chunk": 2500,
    },
}

# group -> (ceiling key in the per-GPU ceilings, unit); each group holds one mgpu figure.
GROUPS: dict[str, tuple[str, str]] = {
    "matmul-float32": ("gemm_float32", "TFLOP/s"),
    "matmul-float64": ("gemm_float64", "TFLOP/s"),
    "matmul-tf32": ("gemm_tf32", "TFLOP/s"),
    "dot-float32": ("copy", "GB/s"),
    "local-cupy-dot": ("gemm_float64", "TFLOP/s"),
}

PEER_REPEAT = 2  # timed repetitions per dask.array figure (after one untimed warm-up)
LOCAL_CUPY_RUNS = ["--runs", "2", "--warmup-runs", "1"]


# -- pure helpers (tested on CPU) ------------------------------------------------------


def parse_dask_time(text: str) -> float:
    """Seconds from ``dask.utils.format_time`` text ('1.66 s', '523.41 ms', '20m 34s', ...)."""
    text = text.strip()
    m = re.fullmatch(r"([\d.]+) (s|ms|us)", text)
    if m:
        return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]
    total, units = 0.0, {"d": 86400.0, "hr": 3600.0, "m": 60.0, "s": 1.0}
    parts = text.split()
    for part in parts:
        m = re.fullmatch(r"(\d+)(d|hr|m|s)", part)
        if not m:
            raise ValueError(f"not a dask format_time string: {text!r}")
        total += int(m.group(1)) * units[m.group(2)]
    if not parts:
        raise ValueError("empty time string")
    return total


def parse_local_cupy_text(text: str) -> dict[str, Any]:
    """The per-run wall clocks and the summary line of local_cupy's printed table.

    The table (dask_cuda.benchmarks.utils.print_throughput_bandwidth) reads::

        Wall clock                | Throughput
        ------------------------------------------
        1.68 s                    | 14.19 GiB/s
        ==========================================
        Throughput                | 14.36 GiB/s +/- 121.20 MiB/s
        ...
        Wall clock                | 1.66 s +/- 20.00 ms
    """
    rows = [line for line in text.splitlines()]
    runs: list[float] = []
    mean = std = None
    for i, line in enumerate(rows):
        key, sep, value = line.partition("|")
        if not sep or key.strip() != "Wall clock":
            continue
        if value.strip() == "Throughput":  # the header of the per-run rows
            runs = []
            for row in rows[i + 1 :]:
                if set(row.strip()) == {"="}:
                    break
                if set(row.strip()) == {"-"}:
                    continue
                k, _, _ = row.partition("|")
                runs.append(parse_dask_time(k))
        else:
            a, _, b = value.partition("+/-")
            mean, std = parse_dask_time(a), parse_dask_time(b) if b.strip() else None
    if not runs and mean is None:
        raise ValueError("no 'Wall clock' lines in local_cupy's output")
    return {"runs": runs, "mean": mean, "std": std}


def parse_local_cupy_json(data: dict[str, Any]) -> list[float]:
    """Per-run wall clocks from local_cupy's ``--output-basename`` JSON (pandas, orient=columns)."""
    col = data["wallclock"]
    return [float(col[k]) for k in sorted(col, key=int)]


def build_rows(figures: list[dict[str, Any]], ceilings: dict[str, float] | None) -> list[dict[str, Any]]:
    """Table rows: each figure with its share of the summed ceiling and mgpu's ratio to it.

    Parameters
    ----------
    figures
        Dicts with at least ``group``, ``system`` and ``value`` (a rate, higher is better);
        the figure whose system is ``"mgpu"`` is the reference of its group (other
        ``mgpu-*`` figures, such as kernels alone, get no ratio).
    ceilings
        Summed single-GPU ceilings by key (``gemm_float32``, ``copy``, ...), or None.

    Returns
    -------
    list of dict
        The figures in group order, mgpu's first, each with ``share`` (value over the
        group's ceiling, None without one) and ``mgpu_ratio`` (mgpu's value over this
        one, None for mgpu's own figures or when either is missing).
    """
    order = list(GROUPS)
    rows = []
    for group in order + sorted({f["group"] for f in figures} - set(order)):
        members = [f for f in figures if f["group"] == group]
        ref = next((f["value"] for f in members if f["system"] == "mgpu" and f.get("value")), None)
        ceiling = (ceilings or {}).get(GROUPS.get(group, ("", ""))[0])
        for f in sorted(members, key=lambda f: (f["system"] != "mgpu", not f["system"].startswith("mgpu"))):
            value = f.get("value")
            rows.append(
                {
                    **f,
                    "ceiling": ceiling,
                    "share": value / ceiling if value and ceiling else None,
                    "mgpu_ratio": ref / value if ref and value and not f["system"].startswith("mgpu") else None,
                }
            )
    return rows


def summed_ceilings(per_gpu: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each ceiling summed over the GPUs that measured it."""
    keys = set().union(*per_gpu.values()) if per_gpu else set()
    return {k: sum(g[k] for g in per_gpu.values() if k in g) for k in sorted(keys)}


# -- children: each runs in its own process ----------------------------------------------


def _event_median(cupy: Any, fn: Callable[[], Any], warmup: int, repeat: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(samples), samples


def _gemm(cupy: Any, n: int, dtype: str, tf32: bool, warmup: int, repeat: int) -> dict[str, Any]:
    import numpy as np
    from cupy._core import _routines_linalg as linalg

    rs = cupy.random.RandomState(0)
    a = rs.random_sample((n, n), dtype=dtype)
    b = rs.random_sample((n, n), dtype=dtype)
    c = cupy.empty((n, n), dtype=dtype)
    previous = linalg.get_compute_type(np.float32)
    if tf32:
        linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
    try:
        t, samples = _event_median(cupy, lambda: cupy.matmul(a, b, out=c), warmup, repeat)
    finally:
        linalg.set_compute_type(np.float32, previous)
    return {"value": 2 * n**3 / t / 1e12, "seconds": t, "samples": samples}  # operands freed on return


def _copy_gbps(cupy: Any, nbytes: int) -> float:
    """Device copy bandwidth, bytes read + written, as mgpu's roofline counts it."""
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    t, _ = _event_median(cupy, lambda: dst.__setitem__(slice(None), src), 2, 5)
    return 2 * src.nbytes / t / 1e9


def child_cupy(sizes: dict[str, int], out: dict[str, Any], save: Callable[[], None]) -> None:
    """Plain CuPy, one GPU at a time: ceilings on each GPU, job-sized figures on GPU 0."""
    import cupy

    gemms = (("gemm_float32", "float32", False), ("gemm_float64", "float64", False), ("gemm_tf32", "float32", True))
    out.update(
        ceilings={},
        names={},
        cupy=cupy.__version__,
        runtime=cupy.cuda.runtime.runtimeGetVersion(),
        driver=cupy.cuda.runtime.driverGetVersion(),
    )
    for dev in [int(d) for d in DEVICES.split(",")][: cupy.cuda.runtime.getDeviceCount()]:
        with cupy.cuda.Device(dev):
            ceil = {key: _gemm(cupy, sizes["ceil_n"], dtype, tf32, 2, 5)["value"] for key, dtype, tf32 in gemms}
            ceil["copy"] = _copy_gbps(cupy, sizes["copy_bytes"])
            cupy.get_default_memory_pool().free_all_blocks()
            out["ceilings"][str(dev)] = ceil
            out["names"][str(dev)] = cupy.cuda.runtime.getDeviceProperties(dev)["name"].decode()
            save()
    n = sizes["mm_n"]
    with cupy.cuda.Device(0):
        for key, dtype, tf32 in gemms:
            r = _gemm(cupy, n, dtype, tf32, 1, 3)
            cupy.get_default_memory_pool().free_all_blocks()
            kind = key.split("_")[1]
            out["figures"].append(
                {
                    "group": f"matmul-{kind}",
                    "system": "cupy-1gpu",
                    "unit": "TFLOP/s",
                    "label": f"cupy.matmul {kind} {n}³, one GPU",
                    **r,
                }
            )
            save()
        m = sizes["cupy_dot_n"]
        rs = cupy.random.RandomState(0)
        x = rs.random_sample(m, dtype="float32")
        y = rs.random_sample(m, dtype="float32")
        t, samples = _event_median(cupy, lambda: cupy.dot(x, y), 2, 5)
        out["figures"].append(
            {
                "group": "dot-float32",
                "system": "cupy-1gpu",
                "unit": "GB/s",
                "label": f"cupy.dot float32 {m:.0e}, one GPU",
                "value": 8 * m / t / 1e9,
                "seconds": t,
                "samples": samples,
            }
        )


def _sync_device() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def child_dask_array(sizes: dict[str, int], protocol: str, out: dict[str, Any], save: Callable[[], None]) -> None:
    """dask.array + CuPy on a fresh LocalCUDACluster: matmul and dot, end to end and on persisted inputs.

    The cluster is left for the caller's process exit to end (a UCX shutdown can hang).
    """
    import cupy
    import dask.array as da
    import numpy as np
    from dask.distributed import Client, wait
    from dask_cuda import LocalCUDACluster

    out["protocol"] = protocol
    kwargs: dict[str, Any] = {"protocol": protocol}
    if protocol == "ucx":
        kwargs["enable_nvlink"] = True
    t0 = time.perf_counter()
    cluster = LocalCUDACluster(
        CUDA_VISIBLE_DEVICES=DEVICES,
        n_workers=2,
        threads_per_worker=1,
        rmm_pool_size="40GB",
        dashboard_address=None,
        **kwargs,
    )
    client = Client(cluster)
    client.wait_for_workers(2)
    out["cluster_start_s"] = time.perf_counter() - t0
    out["workers"] = sorted(client.scheduler_info()["workers"])
    out["cluster_kwargs"] = {"n_workers": 2, "rmm_pool_size": "40GB", **kwargs}
    save()
    rs = da.random.RandomState(0, RandomState=cupy.random.RandomState)

    def timed(make_inputs: Callable[[], tuple[Any, Any]], op: Callable[[Any, Any], Any], persisted: bool) -> float:
        x, y = make_inputs()
        if persisted:
            x, y = client.persist([x, y])
            wait([x, y])
            client.run(_sync_device)
        start = time.perf_counter()
        z = client.persist(op(x, y))
        wait(z)
        client.run(_sync_device)
        seconds = time.perf_counter() - start
        client.cancel([z, x, y] if persisted else [z])
        return seconds

    n, c = sizes["mm_n"], sizes["mm_chunk"]
    m, mc = sizes["dot_n"], sizes["dot_chunk"]
    cases = [
        (
            "matmul-float32",
            "TFLOP/s",
            2 * n**3 / 1e12,
            f"matmul f32 {n}³ c{c}",
            lambda: (
                rs.random_sample((n, n), chunks=c, dtype=np.float32),
                rs.random_sample((n, n), chunks=c, dtype=np.float32),
            ),
            lambda x, y: x @ y,
        ),
        (
            "dot-float32",
            "GB/s",
            8 * m / 1e9,
            f"dot f32 {m:.0e} c{mc:.0e}",
            lambda: (
                rs.random_sample(m, chunks=mc, dtype=np.float32),
                rs.random_sample(m, chunks=mc, dtype=np.float32),
            ),
            lambda x, y: da.dot(x, y),
        ),
    ]
    for group, unit, work, label, make, op in cases:
        try:
            timed(make, op, persisted=False)  # warm-up: cuBLAS handles, pools, connections
            for persisted in (False, True):
                samples = [timed(make, op, persisted) for _ in range(PEER_REPEAT)]
                t = statistics.median(samples)
                what = "inputs persisted first" if persisted else "end to end"
                out["figures"].append(
                    {
                        "group": group,
                        "system": f"dask-array-{protocol}" + ("-persisted" if persisted else ""),
                        "label": f"dask.array {label}, {protocol.upper()}, {what}",
                        "unit": unit,
                        "value": work / t,
                        "seconds": t,
                        "samples": samples,
                    }
                )
                save()
        except Exception as e:  # the other case may still run
            out.setdefault("errors", []).append(f"{label}: {type(e).__name__}: {e}")
            save()


def child_main(path: Path, out: dict[str, Any], body: Callable[[Callable[[], None]], None]) -> None:
    """Run a child step's ``body(save)``, saving ``out`` to ``path`` as it goes and at the end
    (with the error, if any); exit without waiting on cluster shutdown."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        os.replace(tmp, path)

    code = 0
    try:
        body(save)
    except Exception as e:
        import traceback

        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
        code = 1
    out["done"] = True
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the parent ends this process group, cluster workers included


def run_child(outdir: Path, sizes: dict[str, int], peer: str, protocol: str) -> None:
    """Run one peer, saving its figures after each."""
    name = "cupy" if peer == "cupy" else f"dask-array-{protocol}"
    out: dict[str, Any] = {"figures": [], "done": False}

    def body(save: Callable[[], None]) -> None:
        if peer == "cupy":
            child_cupy(sizes, out, save)
        else:
            child_dask_array(sizes, protocol, out, save)

    child_main(outdir / "raw" / f"{name}.json", out, body)


# -- the steps the parent runs -----------------------------------------------------------


@dataclass
class Step:
    """One process of the run: its command, time limit, and how to read its figures."""

    name: str
    cmd: list[str]
    timeout: float
    parse: Callable[[Path, Path], dict[str, Any]]  # (raw output path, log path) -> result
    raw: Path


def _parse_child(raw: Path, log: Path) -> dict[str, Any]:
    return json.loads(raw.read_text())


def _parse_mgpu(group: str, label: str) -> Callable[[Path, Path], dict[str, Any]]:
    def parse(raw: Path, log: Path) -> dict[str, Any]:
        r = json.loads(raw.read_text())
        thr = r["throughput"]
        fig = {
            "group": group,
            "system": "mgpu",
            "label": label,
            "unit": thr["unit"],
            "value": thr["value"],
            "kernel": thr.get("kernel"),
            "seconds": r["compute_s"],
            "wall_s": r["wall_s"],
            "compute_s": r["compute_s"],
            "roofline": r.get("roofline"),
            "status": r["status"],
            "verify": r["verify"].get("passed"),
            "plan": r.get("plan"),
            "protocol": r.get("env", {}).get("protocol"),
        }
        figures = [fig]
        if thr.get("kernel"):
            figures.append(
                {
                    "group": group,
                    "system": "mgpu-kernels",
                    "label": label + ", kernels alone",
                    "unit": thr["unit"],
                    "value": thr["kernel"],
                }
            )
        return {"figures": figures, "result": r}

    return parse


def _parse_local_cupy(protocol: str, size: int, chunk: int) -> Callable[[Path, Path], dict[str, Any]]:
    def parse(raw: Path, log: Path) -> dict[str, Any]:
        text = log.read_text(errors="replace")
        printed = None
        try:
            printed = parse_local_cupy_text(text)
        except ValueError:
            pass
        runs, source = None, None
        if raw.exists():  # the --output-basename JSON; its name is uniquified if it existed
            runs, source = parse_local_cupy_json(json.loads(raw.read_text())), "json"
        elif printed and printed["runs"]:
            runs, source = printed["runs"], "printed table"
        if not runs:
            raise ValueError("local_cupy gave neither its JSON nor a 'Wall clock' table")
        t = statistics.median(runs)
        fig = {
            "group": "local-cupy-dot",
            "system": f"local_cupy-{protocol}",
            "label": f"dask-cuda local_cupy -o dot -s {size} -c {chunk}, {protocol.upper()}"
            + (" + NVLink" if protocol == "ucx" else ""),
            "unit": "TFLOP/s",
            "value": 2 * size**3 / t / 1e12,
            "seconds": t,
            "samples": runs,
            "source": source,
        }
        return {"figures": [fig], "printed": printed}

    return parse


def plan_steps(outdir: Path, quick: bool) -> list[Step]:
    """Every step of a run, in the order they run (most needed first)."""
    s = SIZES["quick" if quick else "full"]
    raw = outdir / "raw"
    me = [sys.executable, str(Path(__file__).resolve()), str(outdir)] + (["--quick"] if quick else [])
    steps = [Step("cupy", me + ["--peer", "cupy"], 180, _parse_child, raw / "cupy.json")]
    n, big = s["mm_n"], s["lc_size"]
    mgpu_jobs = [
        (
            "mgpu-matmul-f32",
            "jobs/matmul-32k.yaml",
            "matmul-float32",
            [f"params.{k}={n}" for k in "mnk"],
            f"mgpu matmul float32 {n}³",
        ),
        (
            "mgpu-matmul-f64",
            "jobs/matmul-32k-f64.yaml",
            "matmul-float64",
            [f"params.{k}={n}" for k in "mnk"],
            f"mgpu matmul float64 {n}³",
        ),
        (
            "mgpu-matmul-tf32",
            "jobs/matmul-32k-tf32.yaml",
            "matmul-tf32",
            [f"params.{k}={n}" for k in "mnk"],
            f"mgpu matmul tf32 {n}³",
        ),
        (
            "mgpu-dot",
            "jobs/dot-2g.yaml",
            "dot-float32",
            [f"params.n={s['dot_n']}"],
            f"mgpu dot float32 {s['dot_n']:.0e}",
        ),
        # local_cupy -o dot computes x.dot(y) of two size x size float64 random arrays.
        (
            "mgpu-matmul-40k-f64",
            "jobs/matmul-32k-f64.yaml",
            "local-cupy-dot",
            [f"params.{k}={big}" for k in "mnk"],
            f"mgpu matmul float64 {big}³ (local_cupy's dot)",
        ),
    ]
    for name, job, group, sets, label in mgpu_jobs:
        path = raw / f"{name}.json"
        cmd = [
            sys.executable,
            "-m",
            "mgpu",
            "submit",
            job,
            "--devices",
            DEVICES,
            "--no-dashboard",
            "-q",
            "--json",
            str(path),
        ]
        for kv in sets:
            cmd += ["--set", kv]
        steps.append(Step(name, cmd, 180, _parse_mgpu(group, label), path))
    # TCP first: a UCX start that hangs then costs only the UCX figures.
    for protocol, da_timeout, lc_timeout in (("tcp", 200, 200), ("ucx", 150, 120)):
        steps.append(
            Step(
                f"dask-array-{protocol}",
                me + ["--peer", "dask-array", "--protocol", protocol],
                da_timeout,
                _parse_child,
                raw / f"dask-array-{protocol}.json",
            )
        )
        base = raw / f"local-cupy-{protocol}"
        extra = ["-p", "ucx", "--enable-nvlink"] if protocol == "ucx" else []
        cmd = [
            sys.executable,
            "-m",
            "dask_cuda.benchmarks.local_cupy",
            "-o",
            "dot",
            "-s",
            str(big),
            "-c",
            str(s["lc_chunk"]),
            "-d",
            DEVICES,
            *extra,
            *LOCAL_CUPY_RUNS,
            "--output-basename",
            str(base),
        ]
        steps.append(
            Step(
                f"local-cupy-{protocol}",
                cmd,
                lc_timeout,
                _parse_local_cupy(protocol, big, s["lc_chunk"]),
                base.with_suffix(".json"),
            )
        )
    return steps


def _kill_group(proc: subprocess.Popen) -> None:
    """End the step's process group (its cluster's workers included), TERM then KILL."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(1.0)
            try:  # the leader is gone; workers it left behind may not be
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def _finished(raw: Path) -> bool:
    """Whether a step's raw output is complete (a child marks its last save ``done``)."""
    try:
        return bool(json.loads(raw.read_text()).get("done", True))
    except (OSError, ValueError):
        return False


def run_step(step: Step, logs: Path, timeout: float, grace: float = 30.0) -> dict[str, Any]:
    """Run one step in its own process group with a timeout; parse its output or record why not.

    A step whose output is complete gets ``grace`` seconds to exit before it is ended,
    so a cluster that hangs on shutdown (UCX has) costs little of the run.
    """
    log = logs / f"{step.name}.log"
    for stale in (step.raw, step.raw.with_suffix(".npy"), step.raw.with_suffix(".address_map.json")):
        stale.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    shown = ["python3", *step.cmd[1:]] if step.cmd[0] == sys.executable else step.cmd
    rec: dict[str, Any] = {
        "cmd": " ".join(shown),
        "timeout_s": round(timeout),
        "log": str(log.relative_to(logs.parent)),
    }
    start = time.perf_counter()
    finished_at = None
    with open(log, "w") as fh:
        proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, process_group=0)
        try:
            while True:
                try:
                    rec["rc"] = proc.wait(2.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.perf_counter()
                if finished_at is None and _finished(step.raw):
                    finished_at = now
                if finished_at is not None and now - finished_at > grace:
                    rec["rc"] = None
                    rec["note"] = f"ended {grace:.0f} s after its output was complete (it did not exit)"
                    break
                if now - start > timeout:
                    rec["rc"] = None
                    rec["error"] = f"timed out after {timeout:.0f} s"
                    break
        finally:
            _kill_group(proc)
    rec["seconds"] = time.perf_counter() - start
    problems = [rec.pop("error")] if "error" in rec else []
    if rec["rc"] not in (0, None):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        problems.append(f"exit status {rec['rc']}" + (f": {lines[-1].strip()}" if lines else ""))
    try:
        rec.update(step.parse(step.raw, log))
    except Exception as e:  # a failed step records why and the run goes on
        problems.append(f"no figures ({type(e).__name__}: {e})")
    problems += [rec.pop("error")] if "error" in rec else []  # the child's own account
    problems += rec.get("errors", [])
    problems = [p for i, p in enumerate(problems) if not any(p in q for q in problems[:i])]
    if problems:
        rec["error"] = "; ".join(problems)
        rec["log_tail"] = log.read_text(errors="replace")[-3000:]
    return rec


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in (
        "mgpu",
        "numpy",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "dask",
        "distributed",
        "dask-cuda",
        "rmm-cu13",
        "rmm-cu12",
        "distributed-ucxx-cu13",
        "ucxx-cu13",
        "libucx-cu13",
        "pydantic",
    ):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def _nvidia_smi() -> list[str]:
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return p.stdout.strip().splitlines() or [p.stderr.strip()]
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"nvidia-smi -L failed: {e}"]


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mgpu and its peers, 2 GPUs, one run", title_justify="left")
    for col, just in (
        ("group", "left"),
        ("figure", "left"),
        ("value", "right"),
        ("unit", "left"),
        ("s", "right"),
        ("of 2-GPU ceiling", "right"),
        ("mgpu/peer", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    last = None
    for r in rows:
        table.add_row(
            r["group"] if r["group"] != last else "",
            r["label"],
            f"{r['value']:.4g}" if r.get("value") else "-",
            r["unit"],
            f"{r['seconds']:.3g}" if r.get("seconds") else "-",
            f"{r['share']:.1%}" if r.get("share") else "-",
            f"{r['mgpu_ratio']:.2f}x" if r.get("mgpu_ratio") else "-",
        )
        last = r["group"]
    Console(width=150).print(table)


def orchestrate(outdir: Path, quick: bool, only: set[str] | None, budget: float) -> dict[str, Any]:
    """Run the steps in turn within ``budget`` seconds, rewriting peers.json after each."""
    steps = plan_steps(outdir, quick)
    if only:
        unknown = only - {s.name for s in steps}
        if unknown:
            raise click.BadParameter(
                f"unknown step(s) {sorted(unknown)}; the steps are {[s.name for s in steps]}", param_hint="--only"
            )
        steps = [s for s in steps if s.name in only]
    deadline = time.perf_counter() + budget
    logs = outdir / "logs"
    for d in (outdir, logs, outdir / "raw"):
        d.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv,
        "quick": quick,
        "sizes": SIZES["quick" if quick else "full"],
        "devices": DEVICES,
        "nvidia_smi": _nvidia_smi(),
        "versions": _versions(),
        "steps": {},
        "figures": [],
        "notes": [
            "Values are rates (higher is better); mgpu/peer = mgpu's value over the peer's in the same group.",
            "Ceilings: plain cupy.matmul at ceil_n^3 and a device copy (read + written), each GPU alone, summed.",
            "mgpu's value is work over compute_s, which includes generating its random operands and the "
            "Freivalds check; local_cupy's wall clock and the '-persisted' dask.array figures exclude generation.",
        ],
    }
    out = outdir / "peers.json"
    for step in steps:
        left = deadline - time.perf_counter()
        if left < 30:
            report["steps"][step.name] = {"error": "skipped: the run's time budget is spent"}
            click.echo(f"{step.name:<22} skipped (budget spent)")
            continue
        rec = run_step(step, logs, min(step.timeout, left - 10))
        report["steps"][step.name] = rec
        report["figures"] += rec.get("figures", [])
        if "ceilings" in rec:
            report["ceilings"] = {"per_gpu": rec["ceilings"], "sum": summed_ceilings(rec["ceilings"])}
        figs = ", ".join(f"{f['value']:.4g} {f['unit']}" for f in rec.get("figures", []))
        status = "ok" if "error" not in rec else "FAILED: " + " ".join(rec["error"].split())[:160]
        click.echo(f"{step.name:<22} {rec['seconds']:6.1f} s  {status}  {figs}")
        out.write_text(json.dumps(report, indent=1, default=str))
    report["table"] = build_rows(report["figures"], report.get("ceilings", {}).get("sum"))
    out.write_text(json.dumps(report, indent=1, default=str))
    return report


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("outdir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--quick", is_flag=True, help="small sizes, for a smoke run")
@click.option("--only", metavar="STEP,...", help="run only these steps (cupy, mgpu-matmul-f32, dask-array-ucx, ...)")
@click.option(
    "--budget",
    type=click.FloatRange(60, 3600),
    default=480,
    show_default=True,
    help="seconds for the whole run; later steps are skipped when it is spent",
)
@click.option("--peer", type=click.Choice(["cupy", "dask-array"]), hidden=True)
@click.option("--protocol", type=click.Choice(["tcp", "ucx"]), default="tcp", hidden=True)
def main(outdir: Path, quick: bool, only: str | None, budget: float, peer: str | None, protocol: str) -> None:
    """Run mgpu and its peers (plain CuPy, dask.array + CuPy over TCP and UCX, dask-cuda's
    local_cupy) on GPUs 0 and 1; print a table and write OUTDIR/peers.json."""
    sizes = SIZES["quick" if quick else "full"]
    outdir = outdir.resolve()  # children run in the repository root
    if peer:  # a child: one fresh process per peer, its figures to OUTDIR/raw/ as they come
        run_child(outdir, sizes, peer, protocol)
        return
    report = orchestrate(outdir, quick, set(only.split(",")) if only else None, budget)
    print_table(report["table"])
    click.echo(f"wrote {outdir / 'peers.json'}")


if __name__ == "__main__":
    main()
