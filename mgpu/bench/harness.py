"""What every suite shares: its options, the machine record, running mgpu's jobs through
the scaling sweep (:mod:`mgpu.scale`), running an alternative in a child process, and
writing the one record."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mgpu.gpus import driver_version, nvml_gpus, visible_count
from mgpu.scale import Run, plan_sweep, run_sweep

SCHEMA = "mgpu-bench/1"
# Popen keywords that make a child the leader of a new process group, so one killpg ends it
# and everything it started.
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
PRESETS = ("tiny", "small", "full")
_PACKAGES = (
    "mgpu",
    "dask",
    "distributed",
    "numpy",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "rmm-cu13",
    "rmm-cu12",
    "dask-cuda",
)


class BenchInputError(ValueError):
    """An option the suite cannot run with; the message names it (exit 2)."""


@dataclass
class Options:
    """The options every suite takes (``mgpu bench SUITE -h`` lists them)."""

    suite: str
    out: Path
    backend: str = "auto"  # auto | cuda | cpu
    devices: list[int] | None = None  # device counts to run on; None: every device
    sizes: str = "auto"  # a preset of PRESETS; auto: full on GPUs, tiny on CPU workers
    repeats: int = 1
    protocol: str = "auto"
    sets: list[str] = field(default_factory=list)  # --set KEY=VALUE for every mgpu job
    force: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # a suite's own options
    command: list[str] = field(default_factory=list)

    @property
    def record_path(self) -> Path:
        return self.out / f"{self.suite}.json"


def parse_devices(text: str) -> list[int] | None:
    """``"all"`` -> None; ``"2"`` -> [2]; ``"1,2,4"`` -> [1, 2, 4] (device counts).

    Raises
    ------
    BenchInputError
        Anything else, naming ``--devices``.
    """
    text = text.strip()
    if text == "all":
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise BenchInputError(f"--devices: expected all, a count (2) or counts (1,2,4), got {text!r}")
    return sorted({int(p) for p in parts})


def gpu_count() -> int:
    """GPUs this process may use where CuPy and dask-cuda are installed, else 0.

    NVML counts them without a CUDA context; ``CUDA_VISIBLE_DEVICES``, which NVML ignores,
    narrows the count as it narrows CUDA's.
    """
    if not (importlib.util.find_spec("cupy") and importlib.util.find_spec("dask_cuda")):
        return 0
    return visible_count()


def resolve(opts: Options) -> tuple[str, str, list[int]]:
    """The backend, the size preset and the device counts this run uses.

    Raises
    ------
    BenchInputError
        ``--backend cuda`` without a GPU, or a device count above what there is.
    """
    gpus = gpu_count()
    backend = opts.backend if opts.backend != "auto" else ("cuda" if gpus else "cpu")
    if backend == "cuda" and not gpus:
        raise BenchInputError("--backend: cuda asked for, but no GPU is visible (or CuPy/dask-cuda are missing)")
    have = gpus if backend == "cuda" else (os.cpu_count() or 1)
    counts = opts.devices or [have]
    if max(counts) > have:
        what = "GPUs" if backend == "cuda" else "CPU cores"
        raise BenchInputError(f"--devices: {max(counts)} asked for, this machine has {have} {what}")
    sizes = opts.sizes if opts.sizes != "auto" else ("full" if backend == "cuda" else "tiny")
    return backend, sizes, counts


def machine() -> dict[str, Any]:
    """The machine a record was measured on: host, CPU, memory, GPUs, driver, packages."""
    import psutil

    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory": psutil.virtual_memory().total,
        "gpus": [],
        "driver": None,
        "packages": {},
    }
    for name in _PACKAGES:
        try:
            info["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if gpu_count():
        info["driver"] = driver_version()
        info["gpus"] = [{"id": g.index, "uuid": g.uuid, "name": g.name, "memory": g.memory} for g in nvml_gpus()]
    return info


def say(message: str) -> None:
    print(f"mgpu bench: {message}", file=sys.stderr, flush=True)


# -- mgpu's jobs ---------------------------------------------------------------------------


def overrides(opts: Options, backend: str) -> list[str]:
    """The harness's ``--set`` overrides of a job, then the user's (the sweep adds the
    device count and the workers per device)."""
    out = [f"cluster.backend={backend}", "cluster.dashboard=null"]
    if opts.protocol != "auto":
        out.append(f"cluster.protocol={opts.protocol}")
    return [*out, *opts.sets]


def plan_all(
    opts: Options,
    jobs: list[tuple[str, dict[str, Any]]],
    backend: str,
    counts: list[int],
    workers: Sequence[int] = (1,),
) -> list[tuple[str, Run]]:
    """Every job's runs on every device count (and number of workers per device), as
    :func:`mgpu.scale.plan_sweep` plans them, validated before anything runs; in order of
    device count and workers, then job, then repeat.

    Raises
    ------
    mgpu.JobInputError
        A job cannot run as written (a wrong ``--set``, say).
    """
    shared = None if tuple(workers) == (1,) else workers
    planned: list[tuple[str, Run]] = []
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-jobs-") as tmp:
        for name, doc in jobs:
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(yaml.safe_dump({"name": name, **doc}, sort_keys=False))
            runs = plan_sweep(path, counts, opts.repeats, overrides=overrides(opts, backend), workers=shared)
            planned += [(name, run) for run in runs]
    return sorted(planned, key=lambda p: (p[1].devices, p[1].workers))  # stable: jobs keep their order


def run_jobs(
    opts: Options,
    jobs: list[tuple[str, dict[str, Any]]],
    backend: str,
    counts: list[int],
    workers: Sequence[int] = (1,),
    *,
    one_cluster: bool = False,
) -> list[dict]:
    """Run every job ``opts.repeats`` times on each device count (with each number of
    ``workers`` per device) through the scaling sweep (:mod:`mgpu.scale`); one entry per run.

    Every job is planned (validated) before the first runs, so a wrong ``--set`` stops
    the suite before anything starts. Each job runs on a cluster of its own; one that
    fails is recorded and the suite goes on. With ``one_cluster`` the jobs of one device
    count and number of workers run one after another on one cluster: what each adds to
    its tiles' time is then the per-job overhead alone; a job that fails ends its
    cluster's batch.
    """
    planned = plan_all(opts, jobs, backend, counts, workers)
    docs = dict(jobs)
    runs: list[dict[str, Any]] = []
    outcomes = run_sweep([run for _, run in planned], one_cluster=one_cluster, keep_going=True)
    for (name, run), outcome in zip(planned, outcomes, strict=True):
        # The job as written and its overrides: `mgpu submit FILE --set ...` reruns it
        # (the result's `job` is the same job with every default filled in).
        entry: dict[str, Any] = {"name": name, "devices": run.devices, "repeat": run.repeat, "job": docs[name]}
        if run.workers != 1:
            entry["workers_per_device"] = run.workers
        entry["overrides"] = run.overrides
        where = f"{run.devices} device(s)" + (f", {run.workers} workers each" if run.workers != 1 else "")
        if outcome.result is not None:
            entry["result"] = outcome.result.model_dump(mode="json")
            say(f"{name} on {where}, run {run.repeat + 1}: {_describe(entry['result'])}")
        else:
            entry["result"], entry["error"] = None, outcome.error
            say(f"{name} on {where}: {outcome.error}")
        runs.append(entry)
    return runs


def _describe(r: dict[str, Any]) -> str:
    thr, roof = r["throughput"], r.get("roofline") or {}
    share = f", {roof['fraction']:.1%} of the roofline" if roof.get("fraction") else ""
    return f"{thr['value']:.4g} {thr['unit']}{share} ({r['status']})"


def job_seconds(result: dict[str, Any]) -> float:
    """A result's seconds without the cluster's start, the ceilings, the plan and the warm-up."""
    startup = result.get("startup") or {}
    before = sum(startup.get(k) or 0.0 for k in ("cluster_s", "ceilings_s", "plan_s", "warmup_s"))
    return result["wall_s"] - before if startup else result["compute_s"]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job and device count: median throughput and share of the roofline."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for entry in runs:
        groups.setdefault((entry["name"], entry["devices"], entry.get("workers_per_device", 1)), []).append(entry)
    rows = []
    for (name, devices, workers), entries in groups.items():
        ok = [e["result"] for e in entries if e.get("result") and e["result"]["status"] == "ok"]
        values = [r["throughput"]["value"] for r in ok]
        fractions = [r["roofline"]["fraction"] for r in ok if r.get("roofline") and r["roofline"].get("fraction")]
        expected = [r["estimate"]["seconds"] for r in ok if (r.get("estimate") or {}).get("seconds")]
        rows.append(
            {
                "name": name,
                "devices": devices,
                "workers_per_device": workers,
                "runs": len(entries),
                "ok": len(ok),
                "throughput": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "unit": ok[0]["throughput"]["unit"] if ok else None,
                "roofline_fraction": statistics.median(fractions) if fractions else None,
                "roofline_basis": (ok[0].get("roofline") or {}).get("basis") if ok else None,
                "compute_s": statistics.median(r["compute_s"] for r in ok) if ok else None,
                # What submit expected of the tiles' time, and the time they took over it.
                "expected_s": statistics.median(expected) if expected else None,
                "measured_over_expected": statistics.median(
                    r["compute_s"] / e for r, e in zip(ok, expected, strict=True)
                )
                if expected and len(expected) == len(ok)
                else None,
                "job_s": statistics.median(job_seconds(r) for r in ok) if ok else None,
                # What a job adds to its tiles' time once its cluster is up: the per-job overhead.
                "overhead_s": statistics.median(job_seconds(r) - r["compute_s"] for r in ok) if ok else None,
            }
        )
    return rows


# -- the alternatives, each in a child process -------------------------------------------


def run_child(opts: Options, kind: str, label: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``python -m mgpu.bench.alternatives KIND`` with ``args``; its JSON, or why not.

    Its record and log are written in a temporary folder; the record keeps the log's tail
    where the child failed.

    A child of its own process group, killed whole at ``timeout``: an alternative that
    hangs (a UCX start, a driver call) costs its own figures, not the suite.
    """
    with tempfile.TemporaryDirectory(prefix=f"mgpu-bench-{label}-") as raw:
        return _child(kind, label, args, timeout, Path(raw) / f"{label}.json", Path(raw) / f"{label}.log")


def _child(kind: str, label: str, args: dict[str, Any], timeout: float, path: Path, log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mgpu.bench.alternatives", kind, json.dumps(args), str(path)]
    say(f"{label}: running (at most {timeout:.0f} s)")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **_OWN_GROUP)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": f"failed: no answer within {timeout:.0f} s", "log": _tail(log)}
        finally:
            try:  # what the child left behind (a cluster's workers)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if proc.returncode != 0 or not path.exists():
        return {"status": f"failed: exit status {proc.returncode}", "log": _tail(log)}
    return json.loads(path.read_text())


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]


def skipped(why: str) -> dict[str, Any]:
    """The entry of an alternative this machine cannot run."""
    return {"status": f"skipped: {why}"}


# -- the record ----------------------------------------------------------------------------


def check_out(opts: Options) -> None:
    """Refuse to overwrite a record unless ``--force``.

    Raises
    ------
    BenchInputError
        The folder holds this suite's record already, or is a file.
    """
    if opts.out.exists() and not opts.out.is_dir():
        raise BenchInputError(f"--out: {str(opts.out)!r} is a file, not a folder")
    if opts.record_path.exists() and not opts.force:
        raise BenchInputError(f"--out: {str(opts.record_path)!r} exists; choose another folder or pass --force")


def write_record(opts: Options, started: float, resolved: dict[str, Any], body: dict[str, Any]) -> Path:
    """Write ``OUT/SUITE.json``: the command, the machine, the options, then the suite's body."""
    record = {
        "schema": SCHEMA,
        "suite": opts.suite,
        "command": opts.command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - started,
        "machine": machine(),
        "options": {**{k: v for k, v in asdict(opts).items() if k not in ("command", "out")}, **resolved},
        "runs": [],
        "alternatives": {},
        "summary": [],
        **body,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    tmp = opts.record_path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, opts.record_path)
    return opts.record_path
