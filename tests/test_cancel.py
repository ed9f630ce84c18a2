"""Ctrl-C (SIGINT to the terminal's process group) and SIGTERM on ``mgpu submit`` mid-job:
the job's tasks are cancelled, the cluster mgpu started is closed with every process it
had, and nothing is left under the output's name, not even a temporary file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import wait_for
from dask_procs import OWN_GROUP
from test_multinode import ROOT, TILE_DELAY_S, matmul_job, mgpu_cmd, scheduler_task_count, start_slow_cluster


def _wait_for_a_written_tile(folder: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the output's temporary file holds at least one finished tile."""

    def written() -> bool:
        assert proc.poll() is None, proc.communicate()
        for partial in folder.glob(".c.npy.*.partial"):
            try:
                if np.any(np.load(partial, mmap_mode="r")):
                    return True
            except (OSError, ValueError, EOFError):
                pass  # being created
        return False

    wait_for(written, timeout, "a written tile")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_mid_job_cancels_closes_the_cluster_and_keeps_nothing(tmp_path, sig):
    # 64 tiles, 32 a worker: the signal, sent once one is written, lands mid-job (with 16, a
    # job on a quick machine could finish first).
    job = matmul_job(tmp_path, 384, 64, 24, {"m": 12, "n": 32})
    # As python -m mgpu, its workers holding every tile longer (see tests/slow_mgpu.py).
    slow = [sys.executable, str(Path(__file__).with_name("slow_mgpu.py")), str(TILE_DELAY_S)]
    args = [job, "--backend", "cpu", "--devices", "2", "--no-dashboard", "--json", tmp_path / "out.json"]
    cmd = [*slow, "submit", *map(str, args)]
    # Its own process group, as a shell gives a foreground job: Ctrl-C reaches every process in it.
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **OWN_GROUP
    ) as proc:
        _wait_for_a_written_tile(tmp_path, proc)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 2  # the two worker processes of the LocalCluster (and their helpers)
        if sig == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    code = 128 + getattr(signal, sig)
    assert proc.returncode == code, stdout + stderr
    assert f"mgpu: interrupted ({sig})" in stderr and "no partial output was kept" in stderr
    assert "Traceback" not in stdout + stderr
    # No output, no temporary file, no JSON.
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]
    # Every process mgpu started is gone (a moment's grace for the kernel to reap them).
    _, alive = psutil.wait_procs(started, timeout=5)
    assert alive == [], [p.cmdline() for p in alive]


def test_sigterm_on_a_joined_cluster_cancels_the_jobs_tasks_and_leaves_the_cluster(tmp_path):
    cluster = start_slow_cluster(tmp_path / "cluster", n_workers=2)
    try:
        job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})
        cmd = mgpu_cmd(job, "--scheduler", cluster.address, "--json", tmp_path / "out.json")
        with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            _wait_for_a_written_tile(tmp_path, proc)
            with cluster.client() as client:
                assert any(client.processing().values())  # tiles were queued on the workers
                proc.send_signal(signal.SIGTERM)
                stdout, stderr = proc.communicate(timeout=120)
                assert proc.returncode == 143, stdout + stderr
                # The scheduler forgets every task of the job; the workers stay, idle.
                assert scheduler_task_count(client) == 0
                assert not any(client.processing().values())
                assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2
        assert "Traceback" not in stdout + stderr
        assert sorted(os.listdir(tmp_path)) == ["cluster", "job.yaml"]
        assert all(p.poll() is None for p in cluster.processes())
    finally:
        cluster.stop()
