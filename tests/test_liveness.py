"""A stuck worker (stopped with SIGSTOP, as a hung kernel would look) does not hang a job:
past its tiles' deadline it is retired and its tiles run elsewhere, or, with none left, the
job fails naming it; Ctrl-C ends mgpu however things stand, with one line and no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from conftest import wait_for
from dask_procs import OWN_GROUP
from test_cancel import _wait_for_a_written_tile
from test_multinode import ROOT, TILE_DELAY_S, matmul_job, reference

from mgpu.client.run import tile_deadline

# A worker is stuck after 4 s without finishing a tile (each takes TILE_DELAY_S and little more).
FAST_DEADLINE = {"DASK_MGPU__RECOVERY__TILE_DEADLINE_FLOOR": "4s", "DASK_MGPU__RECOVERY__TILE_DEADLINE_SLACK": "1"}


def _workers(pid: int) -> list[psutil.Process]:
    """The Dask worker processes of the cluster mgpu (``pid``) started: its children that listen."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN for c in child.net_connections(kind="tcp")):
                out.append(child)
        except psutil.Error:
            pass
    return sorted(out, key=lambda p: p.create_time())


def _start(tmp_path: Path, *args: str, slow: bool = True, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = (
        [sys.executable, str(Path(__file__).with_name("slow_mgpu.py")), str(TILE_DELAY_S)]
        if slow
        else [
            sys.executable,
            "-m",
            "mgpu",
        ]
    )
    return subprocess.Popen(
        [*cmd, "submit", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **OWN_GROUP,
    )


def _stop_a_worker_once_tiles_run(tmp_path: Path, proc: subprocess.Popen, n_workers: int) -> psutil.Process:
    wait_for(lambda: len(_workers(proc.pid)) >= n_workers, 120, "the workers")
    _wait_for_a_written_tile(tmp_path, proc)
    victim = _workers(proc.pid)[-1]
    victim.suspend()
    return victim


def test_a_stopped_worker_is_retired_and_its_tiles_run_elsewhere(tmp_path):
    job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})  # 16 tiles, 8 a worker
    args = [str(job), "--backend", "cpu", "--devices", "2", "--no-dashboard", "--json", str(tmp_path / "r.json")]
    proc = _start(tmp_path, *args, env=FAST_DEADLINE)
    victim = _stop_a_worker_once_tiles_run(tmp_path, proc, 2)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout + stderr
    assert "Traceback" not in stderr
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE  # retired: killed
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["status"] == "ok" and len(data["recovery"]["lost_workers"]) == 1
    assert data["recovery"]["recomputed_tiles"]
    # Every tile counted once; every worker appears once.
    assert sum(d["tiles"] for d in data["per_device"]) == 16
    assert len({d["worker"] for d in data["per_device"]}) == len(data["per_device"])
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(96, 64, 24), rtol=1e-12, atol=1e-12)


def test_a_job_whose_only_worker_stops_fails_naming_it(tmp_path):
    job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})
    proc = _start(tmp_path, str(job), "--backend", "cpu", "--devices", "1", "--no-dashboard", env=FAST_DEADLINE)
    _stop_a_worker_once_tiles_run(tmp_path, proc, 1)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr
    assert "finished no tile" in stderr and "no other worker is left" in stderr and "tcp://" in stderr
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]  # nothing kept, no claim left


def test_a_worker_slower_than_its_deadline_but_still_heard_from_is_not_retired(tmp_path):
    # Each tile takes 2.5 s against a 1 s deadline (the estimate left something out, as it
    # leaves out decompressing a store's chunks), while the worker's heartbeats still come.
    job = matmul_job(tmp_path, 48, 64, 24, {"m": 24, "n": 64})  # 2 tiles on the one worker
    slow = [sys.executable, str(Path(__file__).with_name("slow_mgpu.py")), "2.5"]
    args = [str(job), "--backend", "cpu", "--devices", "1", "--no-dashboard", "--json", str(tmp_path / "r.json")]
    env = {
        **os.environ,
        "DASK_MGPU__RECOVERY__TILE_DEADLINE_FLOOR": "1s",
        "DASK_MGPU__RECOVERY__TILE_DEADLINE_SLACK": "1",
    }
    proc = subprocess.run([*slow, "submit", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["status"] == "ok" and data["recovery"]["lost_workers"] == []
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), reference(48, 64, 24), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_mgpu_with_a_stopped_worker(tmp_path, sig):
    job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})
    proc = _start(tmp_path, str(job), "--backend", "cpu", "--devices", "2", "--no-dashboard")
    _stop_a_worker_once_tiles_run(tmp_path, proc, 2)
    started = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stdout + stderr
    assert "Traceback" not in stderr and f"interrupted ({signal.Signals(sig).name})" in stderr
    _, alive = psutil.wait_procs(started, timeout=5)
    assert alive == [], [p.cmdline() for p in alive]
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]


def test_ctrl_c_while_the_cluster_starts_is_one_line(tmp_path):
    job = matmul_job(tmp_path, 96, 64, 24, {"m": 12, "n": 32})
    proc = _start(tmp_path, str(job), "--backend", "cpu", "--devices", "2", "--no-dashboard", slow=False)
    # Both workers listen: the cluster is being set up (its client, its plugins).
    wait_for(lambda: proc.poll() is not None or len(_workers(proc.pid)) == 2, 120, "the workers")
    started = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [
        line for line in stderr.splitlines() if line.startswith("mgpu: interrupted (SIGINT)")
    ]
    _, alive = psutil.wait_procs(started, timeout=5)
    assert alive == [], [p.cmdline() for p in alive]


def test_a_tiles_deadline_is_the_slack_times_its_share_of_the_estimate_never_below_the_floor():
    plan = SimpleNamespace(tiles=list(range(16)))
    # 8 tiles a worker, 2 at once: each worker's tile takes 100 s x 2 x 2 / 16 = 25 s.
    assert tile_deadline(SimpleNamespace(seconds=100.0), plan, 2, 2) == pytest.approx(5 * 25.0)
    assert tile_deadline(SimpleNamespace(seconds=0.01), plan, 2, 1) == 10.0  # the floor
    assert tile_deadline(None, plan, 2, 1) == 10.0  # no estimate: the floor (heartbeats tell slow from stuck)


def test_a_result_after_a_lost_gpu_worker_asks_a_worker_still_there_for_its_environment():
    # Asking the lost worker (the first of the job's) waits out a 30 s connect timeout and
    # then fails the job whose tiles all verified.
    from mgpu.cluster import ClusterInfo
    from mgpu.info import runtime_env
    from mgpu.workload import DeviceFacts

    asked: list[str] = []

    class Client:
        def run(self, fn, workers):
            asked.extend(workers)
            return {workers[0]: {"driver": 13000}}

    devices = {f"tcp://w{i}:1": DeviceFacts("cuda", 0, "NVIDIA H100", 80 << 30, 80 << 30, "h") for i in range(3)}
    resolved = SimpleNamespace(allocator="pool", protocol="tcp")
    info = ClusterInfo(Client(), resolved, owned=True, devices=devices)  # type: ignore[arg-type]
    env = runtime_env(info, lost=["tcp://w0:1"])
    assert asked == ["tcp://w1:1"] and env["worker"] == {"driver": 13000}
    runtime_env(info, lost=["tcp://w0:1", "tcp://w1:1"])  # a later job of the cluster reads it
    assert asked == ["tcp://w1:1"]
