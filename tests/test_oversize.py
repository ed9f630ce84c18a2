"""Jobs larger than the machine: refused up front, in bounded memory, with nothing started.

Each case runs ``python -m mgpu submit`` as a user would, in its own process group and under an
address-space limit (as ``prlimit --as`` would set), and checks the exit code, the one
message naming the key, that no traceback was printed, that nothing was written, that no
process of its group outlived it, and that it peaked well under 1 GiB.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import slow_mgpu
from conftest import invoke, write_job

from mgpu.errors import JobInputError
from mgpu.tiling import MAX_TILES
from mgpu.worker.device import DeviceFacts
from mgpu.workloads.dot import Dot, DotParams
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams
from mgpu.workloads.matmul import Matmul, MatmulParams

ROOT = Path(__file__).resolve().parents[1]
# The limit each mgpu process ran under in the report: 8 GB of address space.
ADDRESS_SPACE = 8_000_000_000


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    max_rss: int  # bytes, of mgpu and every process it waited for
    seconds: float
    leftovers: list[str]  # processes of mgpu's group still alive after it exited


def _group_processes(pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


# Runs mgpu as a child and reports its peak RSS: in a fresh interpreter, RUSAGE_CHILDREN's
# maximum is mgpu's (or that of a process it started and waited for), no other test's.
# Its first argument is Python run before mgpu's entry point (a fault to inject, say).
_PROBE = (
    "import resource, subprocess, sys\n"
    "main = sys.argv[1] + '\\nimport sys; sys.argv[0] = \"mgpu\"\\nfrom mgpu.cli import main; main()'\n"
    "rc = subprocess.call([sys.executable, '-c', main, *sys.argv[2:]])\n"
    "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def _pythonpath() -> str:
    """The checkout first, then whatever this process was given (a GPU machine's packages)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def start_mgpu(
    *args: Any, limits: dict[int, int] | None = None, env: dict[str, str] | None = None, prelude: str = ""
) -> subprocess.Popen:
    """``mgpu ARGS`` in a process group of its own, under ``limits`` (rlimit -> bytes).

    The address space is limited to 8 GB unless ``limits`` says otherwise, so a job that
    tries to hold what it cannot fails here instead of taking the machine down.
    """
    limits = {resource.RLIMIT_AS: ADDRESS_SPACE, **(limits or {})}

    def preexec() -> None:
        os.setpgid(0, 0)  # the leader of a new group, as a shell starts a job
        for which, value in limits.items():
            resource.setrlimit(which, (value, value))

    return subprocess.Popen(
        [sys.executable, "-c", _PROBE, prelude, *map(str, args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )


def finish_mgpu(proc: subprocess.Popen, start: float, timeout: float = 300, stdout: str = "") -> Run:
    """Wait for mgpu; then find what it left running in its process group, and kill that."""
    try:
        out, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    seconds = time.perf_counter() - start
    # What mgpu started and left behind is reparented but keeps the process group.
    deadline = time.monotonic() + 10
    leftovers = _group_processes(proc.pid)
    while leftovers and time.monotonic() < deadline:  # a worker being closed may still be exiting
        psutil.wait_procs(leftovers, timeout=0.5)
        leftovers = _group_processes(proc.pid)
    names = []
    for p in leftovers:  # never leave them to the next test
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(p.cmdline()[:4]))
            p.kill()
    rss = [ln for ln in stderr.splitlines() if ln.startswith("MAXRSS ")]
    assert rss, stderr
    stderr = "".join(ln + "\n" for ln in stderr.splitlines() if not ln.startswith("MAXRSS "))
    return Run(proc.returncode, stdout + out, stderr, int(rss[-1].split()[1]), seconds, names)


def run_mgpu(*args: Any, limits: dict[int, int] | None = None, prelude: str = "", timeout: float = 300) -> Run:
    """``mgpu ARGS`` to its end (see :func:`start_mgpu` and :func:`finish_mgpu`)."""
    start = time.perf_counter()
    return finish_mgpu(start_mgpu(*args, limits=limits, prelude=prelude), start, timeout)


def assert_refused(run: Run, key: str, *phrases: str) -> None:
    """Exit 2, one ``mgpu: error:`` line naming ``key``, no traceback, nothing left behind."""
    assert run.code == 2, run.stderr
    assert "Traceback" not in run.stderr and "Error:" not in run.stderr.replace("mgpu: error:", ""), run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mgpu: error: {key}"), run.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    assert run.leftovers == []
    assert run.max_rss < 1 << 30, f"mgpu peaked at {run.max_rss / 2**20:.0f} MiB refusing the job"


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _job(tmp_path: Path, workload: str, params: dict[str, Any], **extra: Any) -> Path:
    doc = {"workload": workload, "params": params, "cluster": {"backend": "cpu", "dashboard": None}, **extra}
    return write_job(tmp_path / "job.yaml", doc)


# -- the cases of the report ------------------------------------------------------------


def test_matmul_of_ten_million_cubed_with_an_output_is_refused_for_its_size(tmp_path):
    job = _job(tmp_path, "matmul", {"m": 10**7, "n": 10**7, "k": 10**7, "output": str(tmp_path / "c.npy")})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "params.output", "363.80 TiB", str(tmp_path / "c.npy"))
    assert _listing(tmp_path) == ["job.yaml"]


def test_matmul_of_ten_million_cubed_is_refused_for_its_tile_count(tmp_path):
    job = _job(tmp_path, "matmul", {"m": 10**7, "n": 10**7, "k": 10**7})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "params.m, params.n", f"at most {MAX_TILES:,} tiles")
    assert run.seconds < 30  # no cluster was started: a refusal costs the imports only


def test_output_larger_than_the_free_disk_is_refused(tmp_path):
    # 10^6 x 10^6 float32 is 3.6 TiB; the report's disk had 79 GiB free.
    job = _job(tmp_path, "matmul", {"m": 10**6, "n": 10**6, "k": 64, "output": str(tmp_path / "c.npy")})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "params.output", "3.64 TiB", "free")
    assert _listing(tmp_path) == ["job.yaml"]


def test_mandelbrot_larger_than_the_filesystem_is_refused(tmp_path):
    out = tmp_path / "m.npy"
    job = _job(tmp_path, "mandelbrot", {"width": 10**7, "height": 10**7, "output": {"npy": str(out)}})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "params.output.npy", str(out))
    assert _listing(tmp_path) == ["job.yaml"]


def test_dot_of_ten_trillion_is_refused_for_its_tile_count(tmp_path):
    job = _job(tmp_path, "dot", {"n": 10**13})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "params.n", "tiles")


# -- limits of the filesystem and the process ----------------------------------------------


def test_output_over_the_file_size_limit_is_refused(tmp_path):
    out = tmp_path / "c.npy"
    job = _job(tmp_path, "matmul", {"m": 1024, "n": 1024, "k": 64, "output": str(out)})  # 4 MiB
    run = run_mgpu("submit", job, "-q", limits={resource.RLIMIT_FSIZE: 1 << 20})
    assert_refused(run, "params.output", "ulimit -f", "1.00 MiB")
    assert _listing(tmp_path) == ["job.yaml"]


def test_outputs_of_several_jobs_together_must_fit_the_free_space(tmp_path, monkeypatch):
    free = 5 << 20

    class FakeStat:
        f_bavail, f_frsize = free // 4096, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: FakeStat())
    jobs = []
    for name in ("one", "two"):  # 4 MiB each: either fits alone, not both
        jobs.append(
            write_job(
                tmp_path / f"{name}.yaml",
                {
                    "workload": "matmul",
                    "params": {"m": 1024, "n": 1024, "k": 64, "output": str(tmp_path / f"{name}.npy")},
                    "cluster": {"backend": "cpu", "dashboard": None},
                },
            )
        )
    res = invoke("submit", *jobs, "-q")
    assert res.code == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("mgpu: error: params.output: ")
    assert "need 8.00 MiB" in res.stderr and "5.00 MiB free" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.yaml", "two.yaml"]


def test_a_band_row_wider_than_the_budget_is_refused(tmp_path):
    job = _job(tmp_path, "mandelbrot", {"width": 10**6, "height": 4}, cluster={"backend": "cpu", "memory_limit": "1MB"})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "params.width", "per band")


def test_a_smallest_tile_over_the_budget_is_refused_before_a_cluster_starts(tmp_path):
    job = _job(tmp_path, "matmul", {"m": 4096, "n": 4096, "k": 4096}, cluster={"backend": "cpu", "memory_limit": "1MB"})
    run = run_mgpu("submit", job, "-q")
    assert_refused(run, "cluster.memory_limit", "budget")
    assert run.seconds < 30


# -- planning in bounded memory -------------------------------------------------------------


def _cpus(n: int, memory: int = 12 << 30) -> dict[str, DeviceFacts]:
    return {f"cpu-{i}": DeviceFacts("cpu", i, "cpu", memory, memory, "host") for i in range(n)}


@pytest.mark.parametrize(
    "make",
    [
        lambda: Matmul(MatmulParams(m=10**7, n=10**7, k=10**7)),
        lambda: Matmul(MatmulParams(m=10**7, n=10**7, k=10**7, operands="distributed")),
        lambda: Dot(DotParams(n=10**13)),
        lambda: Mandelbrot(MandelbrotParams(width=10**7, height=10**7)),
    ],
    ids=["matmul", "matmul-distributed", "dot", "mandelbrot"],
)
def test_planning_a_job_of_any_size_is_quick_and_small(make):
    def plan() -> int:
        try:
            return len(make().plan(_cpus(2), 6 << 30, {}, spill=True).tiles)
        except JobInputError as e:  # refused for its tile count, having made none
            assert f"at most {MAX_TILES:,} tiles" in str(e)
            return 0

    start = time.process_time()  # CPU time: other processes on the machine do not count
    plan()
    seconds = time.process_time() - start
    tracemalloc.start()
    tiles = plan()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # A plan made holds its tiles (what the run needs) and little else.
    assert seconds < 1.0 and peak < (1 << 20) + 600 * tiles, (seconds, peak, tiles)


def test_a_tall_image_is_planned_in_bounded_memory():
    # 10^7 rows in bands of 1000: 10,000 bands, costed in groups of rows, not row by row.
    workload = Mandelbrot(MandelbrotParams(width=1000, height=10**7, max_iter=100))
    start = time.process_time()  # CPU time: other processes on the machine do not count
    workload.plan(_cpus(2), 1 << 30, {"rows": 1000})
    seconds = time.process_time() - start
    tracemalloc.start()
    plan = workload.plan(_cpus(2), 1 << 30, {"rows": 1000})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(plan.tiles) == 10_000
    assert sum(t.size("rows") for t in plan.tiles) == 10**7
    assert seconds < 1.0 and peak < 32 << 20, (seconds, peak)


# -- failures mid-way: one message, exit 1, nothing kept, nothing left running ------------------


def assert_failed_cleanly(run: Run, folder: Path, before: list[str], *phrases: str) -> None:
    """Exit 1, the cause named, no traceback, no output or partial file, no process left."""
    assert run.code == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    for phrase in phrases:
        assert phrase in run.stderr, run.stderr
    assert _listing(folder) == before  # neither the output nor its partial file
    assert run.leftovers == []


def _matmul_files(tmp_path: Path, m: int = 512, k: int = 256, n: int = 512) -> tuple[Path, Path]:
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, rng.standard_normal((m, k), dtype=np.float32))
    np.save(b, rng.standard_normal((k, n), dtype=np.float32))
    return a, b


@pytest.mark.parametrize("change", ["truncated", "replaced"])
def test_an_input_file_changed_while_the_job_reads_it_fails_the_job_cleanly(tmp_path, change):
    import numpy as np

    a, b = _matmul_files(tmp_path)
    job = _job(
        tmp_path,
        "matmul",
        {"input": {"a": str(a), "b": str(b)}, "output": str(tmp_path / "c.npy")},
        tiling={"m": 64, "n": 512},
    )
    before = _listing(tmp_path)
    start = time.perf_counter()
    # Each tile waits two seconds before it reads, so the file changes under a running job.
    proc = start_mgpu("submit", job, prelude=slow_mgpu.prelude(2.0))
    seen = ""
    for line in proc.stdout:  # the plan is printed once the cluster is up, before any tile
        seen += line
        if line.startswith("mgpu: plan:"):
            break
    if change == "truncated":
        with open(a, "r+b") as f:
            f.truncate(1000)
    else:
        np.save(tmp_path / "other.npy", np.zeros((512, 256), dtype=np.float32))
        os.replace(tmp_path / "other.npy", a)
    run = finish_mgpu(proc, start, stdout=seen)
    assert_failed_cleanly(run, tmp_path, before, "input.a", str(a), change)


def test_a_disk_full_when_the_output_is_made_fails_the_job_cleanly(tmp_path):
    # The disk fills between the check of its free space and the output's reservation.
    full = (
        "import errno, os\n"
        "def full(fd, offset, length):\n"
        "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "os.posix_fallocate = full\n"
    )
    out = tmp_path / "c.npy"
    job = _job(tmp_path, "matmul", {"m": 256, "n": 256, "k": 64, "output": str(out)})
    before = _listing(tmp_path)
    run = run_mgpu("submit", job, "-q", prelude=full)
    assert_failed_cleanly(run, tmp_path, before, "params.output", str(out), "No space left on device")
    assert run.stderr.count("mgpu:") == 1


def test_a_tile_larger_than_its_worker_can_hold_fails_the_job_cleanly(tmp_path):
    # The budget is said to be 100 GB, but each worker may map 8 GB: its first chunk of
    # 2 * 10^9 float32 elements (8 GB) cannot be allocated. (A budget past what the workers
    # have is refused before anything starts: the prelude lets this one through, to reach
    # a worker's MemoryError.)
    job = _job(
        tmp_path,
        "dot",
        {"n": 2 * 10**9},
        tiling={"n": 2 * 10**9},
        cluster={"backend": "cpu", "devices": 1, "memory_limit": "100GB", "dashboard": None},
    )
    before = _listing(tmp_path)
    run = run_mgpu(
        "submit", job, "-q", prelude="import mgpu.client.preflight as p\np._check_budget = lambda *a: None\n"
    )
    assert_failed_cleanly(run, tmp_path, before, "ran out of memory", "MemoryError", "tiling")
    assert run.stderr.count("mgpu:") == 1


@pytest.mark.gpu
def test_a_gpu_allocation_that_fails_with_spill_none_fails_the_job_cleanly(tmp_path):
    import cupy

    # The budget is said to be 1 TB (the prelude lets it past the preflight, which refuses
    # a budget beyond the GPU's memory), so the plan passes; the GPU holds less than the tile's
    # x and y (1.5 times its memory), and with spill: none nothing takes the excess.
    total = cupy.cuda.runtime.memGetInfo()[1]
    n = int(1.5 * total) // 8
    job = _job(
        tmp_path,
        "dot",
        {"n": n},
        tiling={"n": n},
        cluster={
            "backend": "cuda",
            "devices": [0],
            "allocator": "async",
            "spill": "none",
            "memory_limit": "1TB",
            "dashboard": None,
        },
    )
    before = _listing(tmp_path)
    # CUDA reserves far more address space than 8 GB: no limit here.
    run = run_mgpu(
        "submit",
        job,
        "-q",
        limits={resource.RLIMIT_AS: resource.RLIM_INFINITY},
        prelude="import mgpu.client.preflight as p\np._check_budget = lambda *a: None\n",
    )
    assert_failed_cleanly(run, tmp_path, before, "ran out of memory", "spill: managed")
    assert run.stderr.count("mgpu:") == 1


# -- --dry-run and the estimate ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ceiling_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ceilings")


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("job", sorted((ROOT / "jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_dry_run_plans_and_estimates_every_job_and_starts_nothing(job, ceiling_cache, tmp_path):
    import dask.config

    before = _children()
    with dask.config.set({"mgpu.cache-dir": str(ceiling_cache)}):
        res = invoke("submit", job, "--backend", "cpu", "--dry-run", "--json", tmp_path / "plan.json")
    assert res.code == 0, res.output
    assert "mgpu: plan:" in res.stdout and "mgpu: expected" in res.stdout
    assert "running on" not in res.output  # no cluster
    assert _children() <= before  # the calibration's process, where there was one, is gone
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["devices"][0]["backend"] == "cpu" and doc["plan"]["tiles"] >= 1
    assert doc["plan"]["working_set"] <= doc["plan"]["budget"] or doc["job"]["params"].get("operands")
    assert doc["estimate"]["seconds"] > 0


def test_dry_run_refuses_what_submit_refuses(tmp_path):
    job = _job(tmp_path, "matmul", {"m": 10**6, "n": 10**6, "k": 64, "output": str(tmp_path / "c.npy")})
    res = invoke("submit", job, "--dry-run")
    assert res.code == 2 and res.stderr.startswith("mgpu: error: params.output:")
    assert _listing(tmp_path) == ["job.yaml"]
