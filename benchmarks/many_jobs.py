#!/usr/bin/env python3
"""Many jobs in a row on one running cluster: does the cluster grow, or leave processes?

Starts N CPU workers with ``mgpu cluster up`` (its process holds the scheduler and the
workers' nannies; each worker is a process of its own), in a cache folder of its own
(``DASK_MGPU__CACHE_DIR``) so that a cluster the user keeps running is left alone. Then runs
one warm-up job, then JOBS jobs in a row with one ``mgpu submit`` (or one submit each,
``--separate``), each joining that cluster by itself, and measures the resident memory
(RSS) of the scheduler's process and of every worker process before and after, the
processes in each, what the scheduler still holds, the addresses they listen on, and
whether anything outlives ``mgpu cluster down``. Prints a table and writes
``OUT/many_jobs.json``.

    python benchmarks/many_jobs.py --jobs 50 --out results/many-jobs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def write_jobs(folder: Path, n: int) -> list[Path]:
    """Alternate a matmul writing an output file and a dot product, each with its own seed."""
    jobs = []
    for i in range(n):
        if i % 2 == 0:
            doc = {
                "name": f"matmul-{i}",
                "workload": "matmul",
                "params": {"m": 384, "n": 384, "k": 256, "seed": i, "output": str(folder / f"c-{i}.npy")},
                "tiling": {"m": 96},
            }
        else:
            doc = {"name": f"dot-{i}", "workload": "dot", "params": {"n": 2_000_000, "seed": i}}
        path = folder / f"job-{i:03d}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        jobs.append(path)
    return jobs


def cluster_processes(pid: int, address: str) -> dict[str, psutil.Process]:
    """Role -> process: ``scheduler`` for the process ``mgpu cluster up`` started (it holds
    the scheduler and the nannies), ``worker-NAME`` for each worker process, by the name the
    scheduler knows it by, ``submit-server`` for the cluster's submit server (the processes
    it forks for the submits come and go), and whatever else runs under it."""
    from distributed import Client

    with Client(address, timeout=30) as client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        names = {pid: workers[addr]["name"] for addr, pid in client.run(os.getpid).items()}
    top = psutil.Process(pid)
    procs: dict[str, psutil.Process] = {"scheduler": top}
    for child in top.children(recursive=True):
        cmd = " ".join(child.cmdline())
        if child.pid in names:
            procs[f"worker-{names[child.pid]}"] = child
        elif "mgpu.submit_server" in cmd:
            if not _forked_for_a_submit(child):
                procs["submit-server"] = child
        else:  # multiprocessing's resource tracker
            procs[f"{'tracker' if 'resource_tracker' in cmd else 'child'}-{child.pid}"] = child
    return procs


def _forked_for_a_submit(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a process the submit server forked for a submit (they come and go)."""
    try:
        parent = proc.parent()
        return parent is not None and all("mgpu.submit_server" in " ".join(p.cmdline()) for p in (proc, parent))
    except psutil.Error:
        return True  # ended meanwhile


def snapshot(procs: dict[str, psutil.Process]) -> dict[str, Any]:
    out = {}
    for role, p in procs.items():
        try:
            out[role] = {
                "pid": p.pid,
                "rss": p.memory_info().rss,
                "threads": p.num_threads(),
                "children": len([c for c in p.children(recursive=True) if not _forked_for_a_submit(c)]),
                "listen": sorted(
                    {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
                ),
            }
        except psutil.NoSuchProcess:
            out[role] = None
    return out


def scheduler_state(address: str, known: frozenset[str] = frozenset(), waiting: int = 0) -> dict[str, Any]:
    """What the scheduler holds: tasks, workers, worker plugins, and its clients other than
    this one, ``known`` (the client of the process that holds the cluster) and those
    waiting for a submit (counted apart; read once ``waiting`` of them have connected, as
    the process forked for the next submit does a moment after the last one ended)."""
    from distributed import Client

    from mgpu.submit_server import CLIENT_NAME

    with Client(address, timeout=30) as client:
        deadline = time.monotonic() + 30
        while True:  # the scheduler forgets a gone client's tasks a moment after it leaves
            state = client.run_on_scheduler(
                lambda me, dask_scheduler: {
                    "tasks": len(dask_scheduler.tasks),
                    "clients": sorted(c for c in dask_scheduler.clients if c not in (me, "fire-and-forget")),
                    "workers": len(dask_scheduler.workers),
                    "plugins": sorted(dask_scheduler.worker_plugins),
                },
                client.id,
            )
            # The client of the process the cluster's submit server forked ahead for the next submit.
            ahead = [c for c in state["clients"] if c.startswith(f"Client-{CLIENT_NAME}-")]
            state["waiting"] = len(ahead)
            state["clients"] = [c for c in state["clients"] if c not in known and c not in ahead]
            if (state["tasks"] == 0 and state["waiting"] >= waiting) or time.monotonic() > deadline:
                return state
            time.sleep(0.2)


def mgpu(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m mgpu ARGS`` with ``env``; raises if it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "mgpu", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"mgpu {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def submit(jobs: list[Path], json_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """One ``mgpu submit`` of ``jobs``; with no scheduler given it joins the running cluster."""
    cmd = [sys.executable, "-m", "mgpu", "submit", *map(str, jobs), "--json", str(json_path), "-q"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    return {"rc": proc.returncode, "seconds": time.perf_counter() - t0, "stderr": proc.stderr[-4000:]}


def measure(n_jobs: int, n_workers: int, out: Path, *, separate: bool = False) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mgpu-many-", dir=out))
    # A cache folder of its own: its cluster record is the one these submits join.
    env = {**os.environ, "DASK_MGPU__CACHE_DIR": str(work / "cache")}
    jobs = write_jobs(work, n_jobs + 1)
    warmup, jobs = jobs[0], jobs[1:]
    report: dict[str, Any] = {
        "jobs": n_jobs,
        "workers": n_workers,
        "separate": separate,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    mgpu("cluster", "up", "--backend", "cpu", "--devices", str(n_workers), "--no-dashboard", env=env)
    procs: dict[str, psutil.Process] = {}
    try:
        running = json.loads(mgpu("cluster", "status", "--json", env=env).stdout)
        report["address"] = running["address"]
        procs = cluster_processes(running["pid"], running["address"])
        # Before any submit: the one client there is the cluster's own.
        known = frozenset(scheduler_state(running["address"])["clients"])
        report["warmup"] = submit([warmup], work / "warmup.json", env)
        report["before"] = snapshot(procs)
        if separate:
            runs = [submit([job], work / f"result-{i}.json", env) for i, job in enumerate(jobs)]
            results = [
                json.loads((work / f"result-{i}.json").read_text())
                for i in range(len(jobs))
                if (work / f"result-{i}.json").exists()
            ]
            report["run"] = {
                "rc": max(r["rc"] for r in runs),
                "seconds": sum(r["seconds"] for r in runs),
                "stderr": "".join(r["stderr"] for r in runs)[-4000:],
            }
        else:
            report["run"] = submit(jobs, work / "results.json", env)
            path = work / "results.json"
            results = json.loads(path.read_text()) if path.exists() else []
        report["after"] = snapshot(procs)
        report["results"] = {
            "count": len(results),
            "ok": sum(r["status"] == "ok" for r in results),
            "verified": sum(r["verify"]["passed"] is True for r in results),
            "joined": sum(r["job"]["cluster"]["scheduler"] == running["address"] for r in results),
            "lost_workers": sorted({w for r in results for w in r["recovery"]["lost_workers"]}),
        }
        report["scheduler"] = scheduler_state(running["address"], known, waiting=1)
        # mgpu has exited: nothing of it may be left under this process.
        report["stray"] = [" ".join(p.cmdline()[:6]) for p in psutil.Process().children(recursive=True)]
    finally:
        mgpu("cluster", "down", env=env)
    report["left_after_down"] = [role for role, p in procs.items() if p.is_running() and p.status() != "zombie"]
    report["growth"] = {
        role: (report["after"][role]["rss"] - b["rss"]) if b and report["after"][role] else None
        for role, b in report["before"].items()
    }
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['jobs']} jobs in a row ({'one submit each' if report['separate'] else 'one submit'}) "
        f"on {report['workers']} CPU workers, {report['run']['seconds']:.1f} s, exit {report['run']['rc']}; "
        f"{report['results']['ok']}/{report['results']['count']} ok, {report['results']['verified']} verified, "
        f"{report['results']['joined']} on the running cluster at {report['address']}"
    )
    print(f"{'process':<24} {'RSS before':>11} {'RSS after':>11} {'growth':>9} {'children':>9} listens on")
    for role, before in report["before"].items():
        after = report["after"][role]
        if not before or not after:
            print(f"{role:<24} {'gone':>11}")
            continue
        print(
            f"{role:<24} {before['rss'] / MiB:>9.1f}Mi {after['rss'] / MiB:>9.1f}Mi "
            f"{(after['rss'] - before['rss']) / MiB:>+7.1f}Mi {before['children']:>4}->{after['children']:<4} "
            f"{','.join(after['listen']) or '-'}"
        )
    s = report["scheduler"]
    print(
        f"scheduler afterwards: {s['tasks']} tasks, {len(s['clients'])} other clients, "
        f"{s['waiting']} waiting for a submit, {s['workers']} workers, "
        f"worker plugins {s['plugins']}"
    )
    print(f"stray processes: {report['stray'] or 'none'}; left after down: {report['left_after_down'] or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--separate", action="store_true", help="one mgpu submit per job instead of one for all")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "many-jobs")
    args = parser.parse_args()
    report = measure(args.jobs, args.workers, args.out, separate=args.separate)
    (args.out / "many_jobs.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {args.out / 'many_jobs.json'}")
    ok = (
        report["run"]["rc"] == 0
        and report["results"]["ok"] == args.jobs
        and report["results"]["joined"] == args.jobs
        and not report["stray"]
        and not report["left_after_down"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
