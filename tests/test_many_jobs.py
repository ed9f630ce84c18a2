"""Several job files in one ``mgpu submit``: run in order on one cluster, one JSON list; the
cluster sections must agree; and ten jobs in a row on a running cluster (the benchmark
``benchmarks/many_jobs.py`` at a smaller count) leave no growth and no stray process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import invoke, write_job

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def _jobs(tmp_path: Path) -> list[Path]:
    return [
        write_job(
            tmp_path / "a.yaml",
            {"workload": "matmul", "params": {"m": 40, "n": 24, "k": 8, "output": str(tmp_path / "c.npy")}},
        ),
        write_job(tmp_path / "b.yaml", {"workload": "dot", "params": {"n": 10_000, "seed": 3}}),
        write_job(
            tmp_path / "c.yaml",
            {
                "workload": "mandelbrot",
                "params": {"width": 16, "height": 12, "max_iter": 20, "output": {"npy": str(tmp_path / "m.npy")}},
            },
        ),
    ]


def test_several_jobs_run_in_order_on_one_cluster(tmp_path, scheduler):
    res = invoke("submit", *_jobs(tmp_path), "--scheduler", scheduler, "--json", tmp_path / "out.json")
    assert res.code == 0, res.output
    data = json.loads((tmp_path / "out.json").read_text())
    assert [r["job"]["name"] for r in data] == ["a", "b", "c"]
    assert [r["workload"] for r in data] == ["matmul", "dot", "mandelbrot"]
    assert all(r["status"] == "ok" and r["verify"]["passed"] is True for r in data)
    assert data[0]["outputs"] == [str(tmp_path / "c.npy")] and np.load(tmp_path / "c.npy").shape == (40, 24)
    assert np.load(tmp_path / "m.npy").shape == (12, 16)
    # One cluster for all three; each job announced, each result shown.
    assert res.stdout.count("mgpu: running on") == 1
    for i, name in enumerate("abc"):
        assert f"mgpu: job {i + 1} of 3: {name} (" in res.stdout
    assert res.stdout.count("│ status ") == 3  # a table per job


def test_one_job_still_writes_one_object(tmp_path, scheduler):
    res = invoke("submit", _jobs(tmp_path)[1], "--scheduler", scheduler, "--json", "-", "-q")
    assert res.code == 0, res.output
    assert json.loads(res.stdout)["workload"] == "dot"


def test_jobs_whose_cluster_sections_differ_are_refused_before_anything_runs(tmp_path):
    a, b, _ = _jobs(tmp_path)
    write_job(b, {"workload": "dot", "params": {"n": 100}, "cluster": {"devices": 1}})
    res = invoke("submit", a, b, "--backend", "cpu", "--json", tmp_path / "out.json")
    assert res.code == 2, res.output
    assert res.stderr.startswith("mgpu: error: cluster.devices: job 'b' has 1 but the first job, 'a', has 'all'")
    assert "must agree" in res.stderr and "Traceback" not in res.output
    assert sorted(os.listdir(tmp_path)) == ["a.yaml", "b.yaml", "c.yaml"]
    # An override that applies to every job makes them agree.
    res = invoke("submit", a, b, "--backend", "cpu", "--devices", "1", "-q", "--json", tmp_path / "out.json")
    assert res.code == 0, res.output
    assert len(json.loads((tmp_path / "out.json").read_text())) == 2


def test_two_jobs_writing_one_output_are_refused(tmp_path, scheduler):
    a = _jobs(tmp_path)[0]
    res = invoke("submit", a, a, "--scheduler", scheduler)
    assert res.code == 2, res.output
    assert "params.output: jobs 'a' and 'a' both write" in res.stderr
    assert not (tmp_path / "c.npy").exists()


def test_ten_jobs_in_a_row_leave_no_growth_and_no_stray_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "many_jobs.py"), "--jobs", "10", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "many_jobs.json").read_text())
    assert report["run"]["rc"] == 0, report["run"]["stderr"]
    # Each submit joined the cluster mgpu cluster up started, rather than starting its own.
    assert report["results"] == {"count": 10, "ok": 10, "verified": 10, "joined": 10, "lost_workers": []}
    # Nothing of mgpu outlives it; the scheduler holds no task and no client of it.
    assert report["stray"] == [] and report["left_after_down"] == []
    assert report["scheduler"]["tasks"] == 0 and report["scheduler"]["clients"] == []
    assert report["scheduler"]["waiting"] == 1  # the process forked ahead for the next submit
    assert report["scheduler"]["workers"] == 2
    roles = set(report["before"])
    assert "scheduler" in roles and {"worker-0", "worker-1"} <= roles
    for role, before in report["before"].items():
        after = report["after"][role]
        assert after is not None, f"{role} died during the run"
        assert after["children"] == before["children"], role
        # Generous: a leak of a task's inputs or results per job would be tens of MiB here.
        assert report["growth"][role] < 48 * MiB, (role, report["growth"][role])
        assert set(after["listen"]) <= {"127.0.0.1"}, (role, after["listen"])
