"""``mgpu cluster up | status | down`` end to end on CPU workers: a submit finds the
running cluster and runs on its workers, and ``down`` leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import write_job
from distributed import Client
from test_client_imports import gpu_modules_after, stand_ins

ROOT = Path(__file__).resolve().parents[1]


def _mgpu(cache: Path, *args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m mgpu ARGS`` with its own cache folder (where the cluster is recorded)."""
    env = {**os.environ, "DASK_MGPU__CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "mgpu", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _group(pgid: int) -> list[int]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def test_a_submit_runs_on_the_cluster_up_started_and_down_leaves_no_process(tmp_path):
    cache = tmp_path / "cache"
    up = _mgpu(cache, "cluster", "up", "--backend", "cpu", "--devices", "2", "--no-dashboard")
    assert up.returncode == 0, up.stdout + up.stderr
    record = json.loads((cache / "cluster.json").read_text())
    try:
        assert record["workers"] == 2 and record["backend"] == "cpu"
        assert len(_group(record["pid"])) >= 3  # the process holding it, and its workers
        status = _mgpu(cache, "cluster", "status", "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["address"] == record["address"]
        again = _mgpu(cache, "cluster", "up", "--backend", "cpu")
        assert again.returncode == 2 and "one is running already" in again.stderr, again.stderr

        job = write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 100_003}})
        out = tmp_path / "result.json"
        submit = _mgpu(cache, "submit", job, "--json", out)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        assert f"joining the running cluster at {record['address']}" in submit.stdout
        with Client(record["address"]) as client:
            workers = set(client.scheduler_info(n_workers=-1)["workers"])
        result = json.loads(out.read_text())
        assert result["startup"]["cluster_s"] < 2 and {d["worker"] for d in result["per_device"]} == workers
        # Refused after its connection to the cluster was begun: the message alone, nothing else.
        refused = _mgpu(cache, "submit", job, "--json", tmp_path / "missing" / "result.json")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"mgpu: error: --json: the folder '{tmp_path / 'missing'}' does not exist"
        ]
        # A submit to the running cluster imports no GPU library in the client, though one is
        # there: not even while its job loads (Mandelbrot's workload imports Dask's client).
        env = {**stand_ins(tmp_path / "site"), "DASK_MGPU__CACHE_DIR": str(cache)}
        small = write_job(tmp_path / "small.yaml", {"workload": "mandelbrot", "params": {"width": 64, "height": 48}})
        submitted = f"import sys\nfrom mgpu.cli import main\nsys.argv = ['mgpu', 'submit', {str(small)!r}, '-q']\n"
        assert (
            gpu_modules_after(submitted + "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code", env) == []
        )
    finally:
        down = _mgpu(cache, "cluster", "down")
    assert down.returncode == 0 and record["address"] in down.stdout, down.stdout + down.stderr
    assert _group(record["pid"]) == [] and not (cache / "cluster.json").exists()
    status = _mgpu(cache, "cluster", "status")
    assert status.returncode == 1 and "no cluster is up" in status.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--devices", "0"], "cluster.devices: a device count must be at least 1"),
        (["--backend", "cpu", "--memory-limit", "lots"], "cluster.memory_limit"),
        (["--set", "cluster.nope=1"], "cluster.nope: unknown key"),
        (["--set", "nope"], "--set: expected KEY=VALUE"),
        (["--backend", "cpu", "--workers-per-device", "0"], "cluster.workers_per_device"),
    ],
)
def test_cluster_up_refuses_bad_input_and_starts_nothing(tmp_path, args, message):
    cache = tmp_path / "cache"
    res = _mgpu(cache, "cluster", "up", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (cache / "cluster.json").exists()
