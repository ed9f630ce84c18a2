"""``mgpu bench latency``: what a user waits for each built-in job, beside a plain script.

Each job (matmul, dot, Mandelbrot) at two sizes, one short and one the suite's, is run as
a user runs it, timed from outside as the whole command (``python -m mgpu submit``):

``first``    with no ceilings cached (a fresh cache folder): what a new machine pays
``cold``     a cluster started for the job, ceilings cached
``running``  on the cluster ``mgpu cluster up`` started (once, timed too), ``--repeats`` times

beside, in the same run, a plain CuPy script (NumPy on CPU workers) doing the same job on
one device as a user would write it: import, make the operands, compute, check where mgpu
checks by a second product (matmul), copy the answer out. Each result's ``wall_s``,
``compute_s``, ``verify.seconds`` and ``startup`` are kept; the summary sets the command's
time against the script's and gives the per-job overhead (``wall_s - compute_s``), where
it went (the ``startup`` fields' medians) and the client's own (the command's time beyond
``wall_s``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from .harness import Options, resolve, say

__all__ = ["SIZES", "jobs", "run"]

# Per preset: (short, suite) sizes of each job: matmul's side, dot's n, Mandelbrot's side and steps.
SIZES: dict[str, dict[str, tuple[Any, Any]]] = {
    "tiny": {"matmul": (128, 256), "dot": (10_000, 100_000), "mandelbrot": ((64, 20), (256, 50))},
    "small": {"matmul": (1024, 8192), "dot": (1_000_000, 200_000_000), "mandelbrot": ((1024, 1000), (16384, 1000))},
    "full": {
        "matmul": (2048, 32768),
        "dot": (10_000_000, 2_000_000_000),
        "mandelbrot": ((8192, 1000), (65536, 1000)),
    },
}
# Seconds one command may take before the suite records it as failed and goes on.
_TIMEOUT = 600.0

# The plain scripts: the same job on one device, as a user would write it without mgpu.
# argv: the job's params as JSON. They print one JSON line: the answer they copied out.
_SCRIPT = {
    "matmul": """
import json, sys
p = json.loads(sys.argv[1])
import {xp} as xp
m, n, k = p["m"], p["n"], p["k"]
a = xp.random.random((m, k), dtype=xp.float32)
b = xp.random.random((k, n), dtype=xp.float32)
c = a @ b
r = xp.random.random(n) + 0.5  # Freivalds' check in float64
got = c.astype(xp.float64) @ r
want = a.astype(xp.float64) @ (b.astype(xp.float64) @ r)
error = float(abs(got - want).max() / abs(want).max())
print(json.dumps({{"error": error}}))
""",
    "dot": """
import json, sys
p = json.loads(sys.argv[1])
import {xp} as xp
x = xp.random.random(p["n"], dtype=xp.float32)
y = xp.random.random(p["n"], dtype=xp.float32)
value = float((x * y).sum(dtype=xp.float64))
print(json.dumps({{"value": value}}))
""",
    "mandelbrot": """
import json, sys
p = json.loads(sys.argv[1])
import {xp} as xp
w, h, steps = p["width"], p["height"], p["max_iter"]
x = (p["xmin"] + (xp.arange(w) + 0.5) * ((p["xmax"] - p["xmin"]) / w)).astype(xp.float32)
y = (p["ymax"] - (xp.arange(h) + 0.5) * ((p["ymax"] - p["ymin"]) / h)).astype(xp.float32)
{counts}
print(json.dumps({{"iterations": int(counts.sum(dtype=xp.int64))}}))
""",
}
_MANDELBROT_CUPY = """
kernel = xp.ElementwiseKernel(
    "float32 cr, float32 ci, int32 steps", "int32 count",
    "float zr = 0, zi = 0; int n = 0;"
    "while (n < steps && zr * zr + zi * zi <= 4.0f) {"
    " float t = zr * zr - zi * zi + cr; zi = 2.0f * zr * zi + ci; zr = t; ++n; }"
    "count = n;",
    "escape_count")
counts = kernel(x[None, :], y[:, None], xp.int32(steps))
"""
_MANDELBROT_NUMPY = """
counts = xp.zeros((h, w), dtype=xp.int32)
c = x[None, :] + 1j * y[:, None]
z = xp.zeros_like(c)
for _ in range(steps):
    live = abs(z) <= 2
    z[live] = z[live] * z[live] + c[live]
    counts += live
"""


def jobs(sizes: str) -> list[tuple[str, str, dict[str, Any]]]:
    """The suite's jobs at a preset: (name, size label, job document), float32 each."""
    s = SIZES[sizes]
    out: list[tuple[str, str, dict[str, Any]]] = []
    for label, i in (("short", 0), ("suite", 1)):
        side, n = s["matmul"][i], s["dot"][i]
        square = {"m": side, "n": side, "k": side, "dtype": "float32"}
        out.append((f"matmul-{side}", label, {"workload": "matmul", "params": square}))
        out.append((f"dot-{n}", label, {"workload": "dot", "params": {"n": n, "dtype": "float32"}}))
        side, steps = s["mandelbrot"][i]
        image = {"width": side, "height": side, "max_iter": steps, "dtype": "float32", "output": None}
        out.append((f"mandelbrot-{side}", label, {"workload": "mandelbrot", "params": image}))
    return out


def script(workload: str, backend: str) -> str:
    """The plain script of ``workload`` for ``backend`` (CuPy on GPUs, NumPy on CPUs)."""
    xp = "cupy" if backend == "cuda" else "numpy"
    text = _SCRIPT[workload].format(xp=xp, counts=_MANDELBROT_CUPY if xp == "cupy" else _MANDELBROT_NUMPY)
    if xp == "numpy":  # NumPy's random makes float64; the job's operands are float32
        text = text.replace("xp.random.random((m, k), dtype=xp.float32)", "xp.random.random((m, k)).astype(xp.float32)")
        text = text.replace("xp.random.random((k, n), dtype=xp.float32)", "xp.random.random((k, n)).astype(xp.float32)")
        text = text.replace('xp.random.random(p["n"], dtype=xp.float32)', 'xp.random.random(p["n"]).astype(xp.float32)')
    return text


def _command(cmd: list[str], env: dict[str, str], timeout: float = _TIMEOUT) -> dict[str, Any]:
    """Run ``cmd``; its wall time from outside, exit status, and output's tail."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"process_s": None, "rc": None, "status": f"failed: no answer within {timeout:.0f} s"}
    out: dict[str, Any] = {"process_s": time.perf_counter() - start, "rc": proc.returncode}
    if proc.returncode != 0:
        out["status"] = f"failed: exit status {proc.returncode}"
        out["log"] = (proc.stdout + proc.stderr)[-3000:]
    return out


def _submit(job: Path, env: dict[str, str], *flags: str) -> dict[str, Any]:
    """``python -m mgpu submit JOB``, timed from outside; its Result's figures."""
    with tempfile.TemporaryDirectory(prefix="mgpu-latency-") as tmp:
        out = Path(tmp) / "result.json"
        run = _command([sys.executable, "-m", "mgpu", "submit", str(job), "--json", str(out), "-q", *flags], env)
        if out.exists():
            result = json.loads(out.read_text())
            run.update(
                status=result["status"] if run["rc"] == 0 else run.get("status", result["status"]),
                wall_s=result["wall_s"],
                compute_s=result["compute_s"],
                verify_s=(result.get("verify") or {}).get("seconds"),
                startup=result.get("startup"),
                estimate_s=(result.get("estimate") or {}).get("seconds"),
            )
    run.setdefault("status", "ok")
    return run


def _cluster(verb: str, env: dict[str, str], *flags: str) -> dict[str, Any]:
    return _command([sys.executable, "-m", "mgpu", "cluster", verb, *flags], env)


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body)."""
    backend, sizes, _ = resolve(opts)
    devices = int(opts.extra.get("devices") or 1)
    only = opts.extra.get("workloads") or list(_SCRIPT)
    todo = [j for j in jobs(sizes) if j[2]["workload"] in only]
    with tempfile.TemporaryDirectory(prefix="mgpu-latency-") as tmp:
        folder = Path(tmp)
        files = {}
        for name, _, doc in todo:
            path = folder / f"{name}.yaml"
            cluster = {"backend": backend, "devices": devices, "dashboard": None}
            path.write_text(yaml.safe_dump({"name": name, **doc, "cluster": cluster}, sort_keys=False))
            files[name] = path
        cached = folder / "cache"
        base = {**os.environ, "DASK_MGPU__CACHE_DIR": str(cached)}
        runs: list[dict[str, Any]] = []
        # With no ceilings cached: each job's first run on this machine.
        for name, label, _ in todo:
            if label == "suite":
                fresh = {**os.environ, "DASK_MGPU__CACHE_DIR": str(folder / f"fresh-{name}")}
                runs.append(
                    {"name": name, "size": label, "mode": "first", **_submit(files[name], fresh, "--own-cluster")}
                )
                say(f"{name}, first run on a fresh cache: {_describe(runs[-1])}")
        for name, label, _ in todo:
            runs.append({"name": name, "size": label, "mode": "cold", **_submit(files[name], base, "--own-cluster")})
            say(f"{name}, cold: {_describe(runs[-1])}")
        up = _cluster("up", base, "--backend", backend, "--devices", str(devices), "--no-dashboard")
        say(f"cluster up: {up.get('status') or format(up['process_s'], '.2f') + ' s'}")
        try:
            if up["rc"] == 0:
                for name, label, _ in todo:
                    for repeat in range(opts.repeats):
                        entry = {"name": name, "size": label, "mode": "running", "repeat": repeat}
                        runs.append({**entry, **_submit(files[name], base)})
                        say(f"{name}, running cluster, run {repeat + 1}: {_describe(runs[-1])}")
        finally:
            down = _cluster("down", base)
        alternatives: dict[str, Any] = {}
        for name, _, doc in todo:
            params = _params(doc)
            samples = []
            for _ in range(opts.repeats):
                alt = _command(
                    [sys.executable, "-c", script(doc["workload"], backend), json.dumps(params)], _one(backend)
                )
                samples.append(alt)
            ok = [s["process_s"] for s in samples if s["rc"] == 0]
            alternatives[name] = {
                "what": f"a plain {'CuPy' if backend == 'cuda' else 'NumPy'} script on one device",
                "status": "ok" if ok else samples[-1].get("status", "failed"),
                "process_s": statistics.median(ok) if ok else None,
                "samples": ok,
                **({} if ok else {"log": samples[-1].get("log")}),
            }
            say(f"{name}, plain script: {alternatives[name]['process_s'] or alternatives[name]['status']}")
    resolved = {"backend": backend, "sizes": sizes, "devices": devices}
    body = {
        "runs": runs,
        "alternatives": alternatives,
        "cluster": {"up_s": up["process_s"], "up": up.get("status", "ok"), "down_s": down["process_s"]},
        "summary": summarize(runs, alternatives, todo),
    }
    return resolved, body


def _params(doc: dict[str, Any]) -> dict[str, Any]:
    """The job's params, every default the scripts read filled in (the window, the seed)."""
    from ..spec import validate_job

    return validate_job(doc).params.model_dump(mode="json")


def _one(backend: str) -> dict[str, str]:
    """The environment of a plain script: one device, as the mgpu job has."""
    env = dict(os.environ)
    if backend == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    else:  # one core's BLAS, as a CPU worker's
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _describe(run: dict[str, Any]) -> str:
    if run.get("wall_s") is None:
        return f"{run['status']}\n{run.get('log', '')}"
    return (
        f"{run['process_s']:.3f} s command, wall_s {run['wall_s']:.3f}, compute_s {run['compute_s']:.3f} "
        f"({run['status']})"
    )


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _startup_medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each seconds field of the runs' ``startup``, by name."""
    names = list(dict.fromkeys(k for r in runs for k in (r.get("startup") or {}) if k.endswith("_s")))
    return {name: _median([(r.get("startup") or {}).get(name) for r in runs]) for name in names}


def summarize(
    runs: list[dict[str, Any]], alternatives: dict[str, Any], todo: list[tuple[str, str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One row per job: the command's time cold and on a running cluster, set against the
    plain script's; the per-job overhead, the client's own time and the check's share."""
    rows = []
    for name, label, _ in todo:
        mine = {
            mode: [r for r in runs if r["name"] == name and r["mode"] == mode] for mode in ("first", "cold", "running")
        }
        ok = {mode: [r for r in rs if r["status"] == "ok"] for mode, rs in mine.items()}
        running, cold = ok["running"], ok["cold"]
        alt = alternatives.get(name, {}).get("process_s")
        running_s = _median([r["process_s"] for r in running])
        cold_s = _median([r["process_s"] for r in cold])
        checked = [r for r in running + cold if r.get("verify_s") is not None and r["compute_s"] > 0]
        rows.append(
            {
                "name": name,
                "size": label,
                "runs": sum(len(rs) for rs in mine.values()),
                "ok": sum(len(rs) for rs in ok.values()),
                "first_s": _median([r["process_s"] for r in ok["first"]]),
                "first_ceilings_s": _median([(r.get("startup") or {}).get("ceilings_s") for r in ok["first"]]),
                "cold_s": cold_s,
                "running_s": running_s,
                "wall_s": _median([r["wall_s"] for r in running]),
                "compute_s": _median([r["compute_s"] for r in running]),
                # Between the job's start and its result, beyond its tiles: the per-job overhead,
                # and where it went (each startup field's median: they add up to wall_s).
                "overhead_s": _median([r["wall_s"] - r["compute_s"] for r in running]),
                "startup_s": _startup_medians(running),
                # Workers each run sent a warm-up (0: the worker was warm from a run before).
                "warmups": [(r.get("startup") or {}).get("warmups") for r in running],
                # The command beyond the job: the client's imports, connection and exit.
                "client_s": _median([r["process_s"] - r["wall_s"] for r in running]),
                "verify_s": _median([r["verify_s"] for r in checked]),
                "verify_share": max((r["verify_s"] / r["compute_s"] for r in checked), default=None),
                "script_s": alt,
                "running_over_script": running_s / alt if running_s and alt else None,
                "cold_over_script": cold_s / alt if cold_s and alt else None,
            }
        )
    return rows
