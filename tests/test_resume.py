"""A stepped job (the stencil plug-in's bands) that loses a worker mid-job goes on: its bands
go back to their last checkpoint kept on a worker left (or to their inputs) and the job
ends with the fault-free run's bits, its result saying what was lost and from which step
the bands resumed; with no worker left it fails naming the worker, writing nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import wait_for, write_job
from dask_procs import start_proc_cluster, worker_by_name
from faults import SlowSteps

from mgpu.worker import kernels

pytest.importorskip("mgpu_stencil")
from mgpu_stencil import sweep  # noqa: E402 (the plug-in, installed beside mgpu)

ROOT = Path(__file__).resolve().parents[1]
HEIGHT, WIDTH, STEPS = 40, 24, 12
STEP_DELAY_S = 0.1  # every step held this long: the job is still stepping when a worker is killed


def _grid(seed: int) -> np.ndarray:
    return kernels.random_block(
        np, seed=seed, operand=0, rows=(0, HEIGHT), cols=(0, WIDTH), total_cols=WIDTH, dtype="float32"
    )


def _stencil_job(tmp_path: Path, seed: int) -> Path:
    # Two bands per worker: bands 0-1 on worker 0, 2-3 on worker 1, ...; one sweep per
    # exchange, so that the job's steps are its sweeps.
    params = {"height": HEIGHT, "width": WIDTH, "steps": STEPS, "seed": seed, "bands_per_device": 2}
    params["sweeps_per_exchange"] = 1
    return write_job(
        tmp_path / "job.yaml",
        {"workload": "stencil", "params": {**params, "output": str(tmp_path / "grid.npy")}},
    )


def _slow_cluster(folder: Path, n_workers: int, env: dict[str, str] | None = None) -> Any:
    cluster = start_proc_cluster(folder, n_workers=n_workers, env=env)
    try:
        with cluster.client() as client:
            client.register_plugin(SlowSteps(STEP_DELAY_S))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _in_memory(pattern: str) -> Callable[[Any], int]:
    """How many keys the scheduler holds in memory that begin with ``pattern`` (a regular
    expression): a tile ahead of the others may have its next checkpoint kept before a
    slower tile has this one, so a count of checkpoints names the step."""
    keys = re.compile(pattern)

    def count(dask_scheduler: Any) -> int:
        return sum(1 for k, ts in dask_scheduler.tasks.items() if keys.match(str(k)) and ts.state == "memory")

    return count


def _submit_killing(
    cluster: Any,
    job: Path,
    out: Path,
    name: str,
    when: Callable[[Any], bool],
    env: dict[str, str],
    sig: int = signal.SIGKILL,
) -> tuple[int, str, str, str]:
    """Submit ``job`` to ``cluster``, send worker ``name`` ``sig`` (SIGKILL) once
    ``when(client)``; returns (exit code, stdout, stderr, the worker's address). A stopped
    worker is let go on (SIGCONT) once the job has ended."""
    cmd = [sys.executable, "-m", "mgpu", "submit", str(job), "--scheduler", cluster.address, "--json", str(out)]
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    ) as proc:
        with cluster.client() as client:
            victim = worker_by_name(client, name)
            pids = client.run(os.getpid)

            def ended() -> bool:  # a submit that failed at once (a workload not installed)
                return proc.poll() is not None

            wait_for(lambda: ended() or when(client), 60, "the moment to kill a worker", interval=0.02)
        if ended():
            _, stderr = proc.communicate()
            pytest.fail(f"the job ended (exit {proc.returncode}) before a worker could be killed:\n{stderr[-2000:]}")
        os.kill(pids[victim], sig)
        try:
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            if sig == signal.SIGSTOP:
                os.kill(pids[victim], signal.SIGCONT)
    return proc.returncode, stdout, stderr, victim


# (workers, checkpoint-steps, each worker left -> the bands it ends with). Worker 1 (bands 2
# and 3) is lost: with two workers its bands join worker 0's, with three one goes to each
# worker left, so bands next to each other resume on different workers.
CASES = [(2, 0, {"0": [0, 1, 2, 3]}), (2, 4, {"0": [0, 1, 2, 3]}), (3, 4, {"0": [0, 1, 2], "2": [3, 4, 5]})]


@pytest.mark.parametrize("workers,every,ends", CASES, ids=["2-workers-from-inputs", "2-workers", "3-workers"])
def test_a_stencil_that_loses_a_worker_resumes_its_bands_and_gives_the_fault_free_bits(
    tmp_path, workers, every, ends, no_gpu
):
    cluster = _slow_cluster(tmp_path / "cluster", workers)
    bands = 2 * workers
    try:
        job = _stencil_job(tmp_path, seed=3)
        if every:  # once every band's state after step 4 is kept on two workers
            when = lambda c: c.run_on_scheduler(_in_memory(r"stencil-kept-\d+-4-")) >= bands  # noqa: E731
        else:  # once band 2 (worker 1's) has done five steps
            when = lambda c: c.run_on_scheduler(_in_memory("stencil-step-2-4-")) >= 1  # noqa: E731
        env = {"DASK_MGPU__RECOVERY__CHECKPOINT_STEPS": str(every)}
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "1", when, env)
        assert code == 0, stdout + stderr + cluster.logs()
        assert "Traceback" not in stdout + stderr
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["verify"]["passed"] is True and data["backend"] == "cpu"
        (resumed,) = data["recovery"]["resumed_from_steps"]
        said = f"lost worker {victim}; recomputing its tile(s) [2, 3] on the others, every tile stepping again"
        assert f"{said} from step {resumed}" in stdout
        # The bits of the fault-free sweep (the bands give NumPy's sweep exactly).
        np.testing.assert_array_equal(np.load(tmp_path / "grid.npy"), sweep(_grid(3), STEPS))
        recovery = data["recovery"]
        assert recovery["lost_workers"] == [victim]
        assert recovery["recomputed_tiles"] == [2, 3]  # worker 1's bands, finished on the others
        if every:
            assert resumed in (4, 8), resumed  # a checkpoint, not the inputs
        else:
            assert resumed == 0
        # Each band once, on the workers left; the work is the whole job's, once.
        assert data["plan"]["tiles"] == bands
        with cluster.client() as client:
            names = {worker_by_name(client, name): name for name in ends}
        got = {names[d["worker"]]: d["tiles"] for d in data["per_worker"]}
        assert got == {name: len(tiles) for name, tiles in ends.items()}
        grid_bytes = HEIGHT * WIDTH * 4
        rate = data["throughput"]["value"] * 1e9 * data["compute_s"]
        assert rate == pytest.approx(2 * grid_bytes * STEPS, rel=1e-6)
        # The bands' span covers the job from the first step to the last (the lost steps in it).
        assert data["compute_s"] >= STEPS * STEP_DELAY_S
        assert sorted(os.listdir(tmp_path)) == ["cluster", "grid.npy", "job.yaml", "out.json"]
    finally:
        cluster.stop()


def test_a_stencil_that_loses_its_only_worker_fails_naming_it_and_writes_nothing(tmp_path, no_gpu):
    cluster = _slow_cluster(tmp_path / "cluster", 1)
    try:
        job = _stencil_job(tmp_path, seed=1)
        when = lambda c: c.run_on_scheduler(_in_memory("stencil-step-0-2-")) >= 1  # noqa: E731
        env = {"DASK_MGPU__RECOVERY__WAIT_FOR_WORKERS": "1s", "DASK_MGPU__RECOVERY__CHECKPOINT_STEPS": "2"}
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "0", when, env)
        assert code == 1, stdout + stderr
        assert "Traceback" not in stdout + stderr
        assert f"mgpu: job failed: every worker was lost ({victim})" in stderr
        assert sorted(os.listdir(tmp_path)) == ["cluster", "job.yaml"]  # no result, no output, no temporary
    finally:
        cluster.stop()


def test_a_submit_that_fails_at_once_ends_the_wait_with_its_error(tmp_path, no_gpu):
    # As on a machine where the plug-in has no entry point: the test fails at once with the
    # submit's message, not 60 s later with a timeout that hides it.
    cluster = _slow_cluster(tmp_path / "cluster", 1)
    try:
        job = write_job(tmp_path / "job.yaml", {"workload": "no-such-workload", "params": {}})
        with pytest.raises(pytest.fail.Exception, match=r"exit 2\)[\s\S]*unknown workload 'no-such-workload'"):
            _submit_killing(cluster, job, tmp_path / "out.json", "0", lambda client: False, {})
    finally:
        cluster.stop()


def test_a_stencil_whose_worker_stops_retires_it_within_the_floor_and_resumes(tmp_path, no_gpu):
    # The stencil has no estimate: its deadline is the floor, and the stopped worker, which
    # the scheduler no longer hears from, is retired then (not after the 10 minutes a worker
    # still heard from is given).
    cluster = _slow_cluster(tmp_path / "cluster", 2)
    try:
        job = _stencil_job(tmp_path, seed=4)
        when = lambda c: c.run_on_scheduler(_in_memory("stencil-step-2-2-")) >= 1  # noqa: E731
        env = {"DASK_MGPU__RECOVERY__TILE_DEADLINE_FLOOR": "3s"}
        code, stdout, stderr, victim = _submit_killing(
            cluster, job, tmp_path / "out.json", "1", when, env, sig=signal.SIGSTOP
        )
        assert code == 0, stdout + stderr + cluster.logs()
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["recovery"]["lost_workers"] == [victim]
        assert data["recovery"]["resumed_from_steps"] == [0]
        np.testing.assert_array_equal(np.load(tmp_path / "grid.npy"), sweep(_grid(4), STEPS))
    finally:
        cluster.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("every", [0, 4])
def test_a_stencil_on_gpu_workers_that_loses_one_resumes_with_the_same_bits(tmp_path, every):
    # Two `dask worker` processes on GPU 0: the bands between them pass through CUDA IPC, and a
    # resumed band's state comes back from host memory to the device.
    pytest.importorskip("cupy")
    cluster = _slow_cluster(tmp_path / "cluster", 2, env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        job = _stencil_job(tmp_path, seed=5)
        if every:  # once every band's state after step 4 is kept on two workers
            when = lambda c: c.run_on_scheduler(_in_memory(r"stencil-kept-\d+-4-")) >= 4  # noqa: E731
        else:
            when = lambda c: c.run_on_scheduler(_in_memory("stencil-step-2-4-")) >= 1  # noqa: E731
        env = {"DASK_MGPU__RECOVERY__CHECKPOINT_STEPS": str(every)}
        code, stdout, stderr, victim = _submit_killing(cluster, job, tmp_path / "out.json", "1", when, env)
        assert code == 0, stdout + stderr + cluster.logs()
        data = json.loads((tmp_path / "out.json").read_text())
        assert data["status"] == "ok" and data["backend"] == "cuda"
        # Both workers report GPU 0: which one holds bands 0-1 is the order of their addresses.
        lost = data["recovery"]["recomputed_tiles"]
        assert data["recovery"]["lost_workers"] == [victim] and lost in ([0, 1], [2, 3])
        assert f"lost worker {victim}; recomputing its tile(s) {lost}" in stdout
        (resumed,) = data["recovery"]["resumed_from_steps"]
        assert resumed in ((4, 8) if every else (0,)), resumed
        # The CUDA kernel does NumPy's arithmetic: the bits of the fault-free sweep.
        np.testing.assert_array_equal(np.load(tmp_path / "grid.npy"), sweep(_grid(5), STEPS))
    finally:
        cluster.stop()
