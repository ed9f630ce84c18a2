"""Joining a running cluster of separate processes (``dask scheduler`` + ``dask worker``, as
across nodes) through the CLI, and losing workers mid-job: the job still completes with a
verified, correct result, and the result records what was lost and recomputed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import wait_for, write_job
from dask_procs import start_proc_cluster, wait_until_processing, worker_by_name
from faults import SlowTiles

from mgpu.worker import kernels

ROOT = Path(__file__).resolve().parents[1]


def mgpu_cmd(*args: Any) -> list[str]:
    return [sys.executable, "-m", "mgpu", "submit", *[str(a) for a in args]]


def run_mgpu(*args: Any, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        mgpu_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def matmul_job(tmp_path: Path, m: int, n: int, k: int, tiling: dict[str, int], seed: int = 0) -> Path:
    return write_job(
        tmp_path / "job.yaml",
        {
            "workload": "matmul",
            "params": {"m": m, "n": n, "k": k, "dtype": "float64", "seed": seed, "output": str(tmp_path / "c.npy")},
            "tiling": tiling,
        },
    )


def reference(m: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    a = kernels.random_block(np, seed=seed, operand=0, rows=(0, m), cols=(0, k), total_cols=k, dtype="float64")
    b = kernels.random_block(np, seed=seed, operand=1, rows=(0, k), cols=(0, n), total_cols=n, dtype="float64")
    return a @ b


def scheduler_task_count(client: Any, timeout: float = 30) -> int:
    """Tasks the scheduler still holds, once the client that submitted them has gone."""
    counts: list[int] = []

    def drained() -> bool:
        counts.append(client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)))
        return counts[-1] == 0

    try:
        wait_for(drained, timeout, "the scheduler forgetting the tasks")
    except TimeoutError:
        pass  # the caller's assertion shows the count
    return counts[-1]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cluster = start_proc_cluster(tmp_path_factory.mktemp("cluster"), n_workers=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_submit_joins_a_running_cluster_by_scheduler_file_and_leaves_it_running(tmp_path, two_workers):
    job = matmul_job(tmp_path, 64, 48, 40, {"m": 16})
    proc = run_mgpu(job, "--scheduler-file", two_workers.scheduler_file, "--json", tmp_path / "out.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr + two_workers.logs()
    assert "Traceback" not in proc.stdout + proc.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["status"] == "ok" and data["verify"]["passed"] is True
    assert data["job"]["cluster"]["scheduler"] == str(two_workers.scheduler_file)
    # Tiles ran on both workers the scheduler reported (named 0 and 1), two each.
    assert sorted(d["id"] for d in data["devices"]) == [0, 1]
    assert sorted(d["tiles"] for d in data["per_device"]) == [2, 2]
    assert data["recovery"] == {"lost_workers": [], "recomputed_tiles": [], "resumed_from_steps": []}
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(64, 48, 40), rtol=1e-12, atol=1e-12)
    # The cluster is still there, whole, and holds nothing of the job.
    assert all(p.poll() is None for p in two_workers.processes())
    with two_workers.client() as client:
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2
        assert scheduler_task_count(client) == 0


def test_scheduler_file_and_address_together_are_a_usage_error(tmp_path, two_workers):
    job = matmul_job(tmp_path, 8, 8, 8, {"m": 4})
    proc = run_mgpu(job, "--scheduler-file", two_workers.scheduler_file, "--scheduler", two_workers.address)
    assert proc.returncode == 2 and "not both" in proc.stderr and "Traceback" not in proc.stderr


def test_a_scheduler_that_is_neither_address_nor_file_is_refused(tmp_path):
    job = matmul_job(tmp_path, 8, 8, 8, {"m": 4})
    proc = run_mgpu(job, "--scheduler", "no-such-file.json")
    assert proc.returncode == 2, proc.stderr
    assert "mgpu: error: cluster.scheduler:" in proc.stderr and "scheduler file" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- losing workers ------------------------------------------------------------------------------

# How much longer every tile is held on a slow cluster's workers: the job is still running
# when a test kills a worker or stops mgpu.
TILE_DELAY_S = 0.3


def start_slow_cluster(folder: Path, n_workers: int = 2, **kwargs: Any) -> Any:
    """A cluster of separate processes (see start_proc_cluster) whose workers hold every
    tile TILE_DELAY_S longer (the SlowTiles worker plugin, kept by the scheduler for any
    worker that joins later)."""
    cluster = start_proc_cluster(folder, n_workers=n_workers, **kwargs)
    try:
        with cluster.client() as client:
            client.register_plugin(SlowTiles(TILE_DELAY_S))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _kill_when_busy(cluster: Any, name: str, job_proc: subprocess.Popen) -> str:
    """SIGKILL worker ``name`` once a tile is in flight on it; returns its address."""
    with cluster.client() as client:
        victim = worker_by_name(client, name)
        pids = client.run(os.getpid)
        wait_until_processing(client, victim, "matmul-tile")
    assert job_proc.poll() is None, "the job ended before a worker could be killed"
    os.kill(pids[victim], signal.SIGKILL)
    return victim


def _submit_killing(
    cluster: Any, job: Path, out: Path, name: str, env: dict[str, str] | None = None
) -> tuple[int, str, str, str]:
    """Submit ``job`` to ``cluster`` and SIGKILL worker ``name`` mid-job; returns (exit code,
    stdout, stderr, the killed worker's address)."""
    with subprocess.Popen(
        mgpu_cmd(job, "--scheduler", cluster.address, "--json", out),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        victim = _kill_when_busy(cluster, name, proc)
        stdout, stderr = proc.communicate(timeout=180)
    return proc.returncode, stdout, stderr, victim


def test_worker_killed_mid_job_its_tiles_are_recomputed_and_the_result_is_correct(tmp_path):
    cluster = start_slow_cluster(tmp_path / "cluster", n_workers=2)
    try:
        # 16 tiles, 8 placed on each worker, each taking at least 0.3 s.
        job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "1")
        assert code == 0, stdout + stderr + cluster.logs()
        assert f"lost worker {victim}" in stdout
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["verify"]["passed"] is True
        assert data["recovery"]["lost_workers"] == [victim]
        recomputed = data["recovery"]["recomputed_tiles"]
        # Worker 1 owned tiles 8-15 and was killed while running its first ones.
        assert recomputed and set(recomputed) <= set(range(8, 16)), recomputed
        # Every tile counted once; the survivor ran its own eight and the recomputed ones.
        assert data["plan"]["tiles"] == 16 and sum(d["tiles"] for d in data["per_device"]) == 16
        assert max(d["tiles"] for d in data["per_device"]) == 8 + len(recomputed)
        np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(96, 64, 24), rtol=1e-12, atol=1e-12)
        assert sorted(os.listdir(tmp_path)) == ["c.npy", "cluster", "job.yaml", "out.json"]
        assert cluster.workers[1].poll() is not None and cluster.workers[0].poll() is None
    finally:
        cluster.stop()


def test_worker_killed_mid_distributed_matmul_its_panels_and_tiles_are_made_again(tmp_path):
    # Its panels die with it: the survivor makes them again (in their chain) and runs its tiles.
    cluster = start_slow_cluster(tmp_path / "cluster", n_workers=2)
    try:
        job = write_job(
            tmp_path / "job.yaml",
            {
                "workload": "matmul",
                "params": {
                    "m": 90,
                    "n": 70,
                    "k": 50,
                    "dtype": "float64",
                    "seed": 2,
                    "operands": "distributed",
                    "output": str(tmp_path / "c.npy"),
                },
            },
        )
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "1")
        assert code == 0, stdout + stderr + cluster.logs()
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["verify"]["passed"] is True
        assert data["recovery"]["lost_workers"] == [victim]
        # Worker 1 owned tiles 4-7 (its row of A against both B panels, each in two pieces).
        recomputed = data["recovery"]["recomputed_tiles"]
        assert data["plan"]["tiles"] == 8 and recomputed and set(recomputed) <= set(range(4, 8)), recomputed
        assert sum(d["tiles"] for d in data["per_device"]) == 8
        np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(90, 70, 50, seed=2), rtol=1e-12, atol=1e-12)
    finally:
        cluster.stop()


def test_worker_restarted_by_its_nanny_takes_the_tiles_back(tmp_path):
    """A worker process killed under a nanny comes back at a new address; the tiles that were
    placed on the old one run on the workers there are then, the restarted one included."""
    cluster = start_slow_cluster(tmp_path / "cluster", n_workers=2, nanny=True)
    try:
        job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32}, seed=5)
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "0")
        assert code == 0, stdout + stderr + cluster.logs()
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["verify"]["passed"] is True
        assert data["recovery"]["lost_workers"] == [victim]
        assert set(data["recovery"]["recomputed_tiles"]) <= set(range(8))
        np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(96, 64, 24, seed=5), rtol=1e-12, atol=1e-12)
        with cluster.client() as client:  # the nanny brought it back under the same name
            client.wait_for_workers(2, timeout=60)
            assert worker_by_name(client, "0") != victim
    finally:
        cluster.stop()


def test_losing_every_worker_fails_the_job_with_a_clear_message(tmp_path):
    cluster = start_slow_cluster(tmp_path / "cluster", n_workers=1)
    try:
        job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})
        env = {**os.environ, "DASK_MGPU__RECOVERY__WAIT_FOR_WORKERS": "1s"}
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "0", env)
        assert code == 1, stdout + stderr
        assert "Traceback" not in stdout + stderr
        assert f"mgpu: job failed: every worker was lost ({victim})" in stderr
        assert "none joined within 1 s" in stderr
        # No result, no output under its name, no temporary file.
        assert sorted(os.listdir(tmp_path)) == ["cluster", "job.yaml"]
        assert psutil.pid_exists(cluster.scheduler.pid)  # the joined cluster's scheduler is left alone
    finally:
        cluster.stop()


@pytest.mark.gpu
def test_gpu_worker_killed_among_four_on_one_gpu_its_tiles_are_recomputed(tmp_path):
    # Four `dask worker` processes on GPU 0, as a joined cluster of workers sharing a GPU.
    pytest.importorskip("cupy")
    cluster = start_slow_cluster(tmp_path / "cluster", n_workers=4, env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32}, seed=7)
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "1")
        assert code == 0, stdout + stderr + cluster.logs()
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["verify"]["passed"] is True and data["backend"] == "cuda"
        assert data["recovery"]["lost_workers"] == [victim] and data["recovery"]["recomputed_tiles"]
        # One GPU, counted once, with the four workers that shared it.
        assert [d["workers"] for d in data["devices"]] == [4]
        assert len(data["per_device"]) == 1 and data["per_device"][0]["tiles"] == data["plan"]["tiles"] == 16
        np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(96, 64, 24, seed=7), rtol=1e-12, atol=1e-12)
    finally:
        cluster.stop()
