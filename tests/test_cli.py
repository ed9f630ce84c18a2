"""The command line: one real ``python -m mgpu`` run, ``info``, ``--version``, ``-h`` and
``--json -``."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import gpu_count, invoke, submit_json, write_job

import mgpu

ROOT = Path(__file__).resolve().parents[1]


def test_python_m_mgpu_submit_example_job(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgpu",
            "submit",
            "jobs/matmul.yaml",
            "--json",
            str(out),
            "--set",
            "params.m=256",
            "--set",
            "params.n=256",
            "--set",
            "params.k=256",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and data["verify"]["passed"] is True
    assert data["job"]["name"] == "matmul"
    assert (data["job"]["params"]["m"], data["job"]["params"]["n"], data["job"]["params"]["k"]) == (256, 256, 256)
    # backend: auto takes the GPUs where there are any.
    assert data["backend"] == ("cuda" if gpu_count() else "cpu")
    assert ("GPU worker" if gpu_count() else "CPU worker") in proc.stdout
    assert len(data["per_device"]) == len(data["devices"]) >= 1
    # The table a person reads is on stdout too.
    assert "status" in proc.stdout and "passed" in proc.stdout


def test_info_says_there_is_no_gpu_and_lists_versions(no_gpu):
    res = invoke("info")
    assert res.code == 0, res.output
    assert "backend cpu" in res.stdout
    assert "no GPU" in res.stdout
    assert f"numpy {np.__version__}" in res.stdout
    assert f"mgpu {importlib.metadata.version('mgpu')}" in res.stdout
    assert "dask " in res.stdout and "distributed " in res.stdout

    res = invoke("info", "--json")
    assert res.code == 0, res.output
    facts = json.loads(res.stdout)
    assert facts["backend"] == "cpu" and facts["gpus"] == []
    assert facts["versions"]["numpy"] == np.__version__
    assert facts["cpus"] >= 1


def test_version():
    res = invoke("--version")
    assert res.code == 0
    assert res.stdout.strip() == f"mgpu, version {mgpu.__version__}"
    assert mgpu.__version__ == importlib.metadata.version("mgpu")


@pytest.mark.parametrize(
    "args,expect",
    [
        (["-h"], ["submit", "info", "Usage:"]),
        (["--help"], ["submit", "info"]),
        (
            ["submit", "-h"],
            ["JOB_FILE", "--scheduler", "--set", "--json", "--devices", "--backend", "--no-verify", "--force"],
        ),
        (["info", "-h"], ["--json"]),
    ],
)
def test_help(args, expect):
    res = invoke(*args)
    assert res.code == 0, res.output
    for word in expect:
        assert word in res.stdout


def test_unknown_command_is_a_usage_error():
    res = invoke("launch")
    assert res.code == 2
    assert "launch" in res.stderr and "Traceback" not in res.output


def test_json_to_stdout_is_valid_json_alone(tmp_path, scheduler):
    job = write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 1000}})
    res = invoke("submit", job, "--scheduler", scheduler, "--json", "-")
    assert res.code == 0, res.output
    data = json.loads(res.stdout)  # nothing but the JSON on stdout
    assert data["status"] == "ok" and data["workload"] == "dot"
    assert res.stdout.lstrip().startswith("{") and res.stdout.rstrip().endswith("}")
    # What a person reads went to stderr instead.
    assert "mgpu: running on" in res.stderr and "status" in res.stderr


def test_quiet_prints_nothing_on_success(tmp_path, scheduler):
    job = write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 1000}})
    res = invoke("submit", job, "--scheduler", scheduler, "-q")
    assert res.code == 0, res.output
    assert res.stdout == "" and res.stderr == ""


def test_result_says_where_the_start_up_went(tmp_path):
    """A cluster mgpu starts: its start, the ceilings, plan, warm-up, first tile, later
    tiles and finish are each timed, in order, and together make the job's wall time."""
    job = write_job(
        tmp_path / "job.yaml",
        {
            "workload": "matmul",
            "params": {"m": 64, "n": 64, "k": 64},
            "cluster": {"backend": "cpu", "devices": 2, "dashboard": None},
        },
    )
    res, data = submit_json(job, tmp_path / "r.json")
    assert res.code == 0, res.output
    st = data["startup"]
    assert st["cluster_s"] > 0.2  # starting two worker processes is never free
    assert all(st[k] >= 0 for k in ("ceilings_s", "plan_s", "warmup_s")) and st["first_tile_s"] > 0
    assert st["warmups"] == 2  # both workers were new
    assert sum(v for k, v in st.items() if k.endswith("_s")) == pytest.approx(data["wall_s"], rel=1e-9)
