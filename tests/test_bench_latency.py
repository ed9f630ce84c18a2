"""``mgpu bench latency`` on CPU workers at tiny sizes: every job is timed as a command,
cold and on a running cluster, beside a plain NumPy script doing the same job; the summary
is the runs' figures; nothing is left running."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import numpy as np
import pytest
from conftest import invoke

from mgpu.bench import latency
from mgpu.spec import validate_job


def test_latency_times_each_job_cold_and_on_a_running_cluster_beside_a_plain_script(tmp_path):
    out = tmp_path / "out"
    res = invoke("bench", "latency", "--backend", "cpu", "--workloads", "dot", "--out", out)
    assert res.code == 0, res.output
    record = json.loads((out / "latency.json").read_text())
    assert record["suite"] == "latency" and record["options"]["sizes"] == "tiny" and record["options"]["devices"] == 1
    assert record["command"][:3] == ["mgpu", "bench", "latency"] and "--workloads" in record["command"]
    runs = record["runs"]
    names = [name for name, _, doc in latency.jobs("tiny") if doc["workload"] == "dot"]
    modes = {(r["name"], r["mode"]) for r in runs}
    # A first run with no ceilings cached for the suite's size; cold and running for both sizes.
    assert modes == {(names[1], "first")} | {(n, m) for n in names for m in ("cold", "running")}
    for r in runs:
        assert r["status"] == "ok" and r["rc"] == 0, r
        # The command holds the job, which holds its tiles; the check's time is recorded.
        assert r["process_s"] > r["wall_s"] >= r["compute_s"] > 0 and r["verify_s"] > 0
    assert record["cluster"]["up"] == "ok"
    for name in names:
        alt = record["alternatives"][name]
        assert alt["status"] == "ok" and alt["process_s"] > 0 and "NumPy" in alt["what"]
        row = next(row for row in record["summary"] if row["name"] == name)
        running = [r for r in runs if r["name"] == name and r["mode"] == "running"]
        assert row["overhead_s"] == statistics.median(r["wall_s"] - r["compute_s"] for r in running)
        assert row["startup_s"]["cluster_s"] == statistics.median(r["startup"]["cluster_s"] for r in running)
        assert set(row["startup_s"]) >= {"cluster_s", "plan_s", "warmup_s", "first_tile_s", "finish_s"}
        assert row["running_over_script"] == pytest.approx(row["running_s"] / alt["process_s"])
    # Each running job is a submit of its own: the first warms the worker up, the second
    # (the same small dot's kernels) finds it warm and sends no warm-up.
    warmups = [next(row for row in record["summary"] if row["name"] == name)["warmups"] for name in names]
    assert warmups == [[1], [0]]
    assert not (tmp_path / "out" / "cluster.json").exists()


@pytest.mark.parametrize("workload", ["matmul", "dot", "mandelbrot"])
def test_the_plain_script_does_the_job_mgpu_does(workload):
    """The alternative computes the same answer (NumPy here): a product that passes
    Freivalds' check, the dot of n pairs, the image's escape counts."""
    name, _, doc = next(j for j in latency.jobs("tiny") if j[2]["workload"] == workload)
    params = validate_job(doc).params.model_dump(mode="json")
    proc = subprocess.run(
        [sys.executable, "-c", latency.script(workload, "cpu"), json.dumps(params)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    if workload == "matmul":
        assert answer["error"] < 1e-5
    elif workload == "dot":
        assert 0.2 * params["n"] < answer["value"] < 0.3 * params["n"]  # E[x y] = 1/4
    else:
        from mgpu.workloads.mandelbrot.kernels import mandelbrot_axes, mandelbrot_counts

        p = params
        x, y = mandelbrot_axes(
            width=p["width"],
            height=p["height"],
            bounds=(p["xmin"], p["xmax"], p["ymin"], p["ymax"]),
            rows=(0, p["height"]),
            dtype="float32",
        )
        want = int(mandelbrot_counts(np, x, y, p["max_iter"]).sum())
        assert answer["iterations"] == pytest.approx(want, rel=0.01)  # complex64 arithmetic, grouped otherwise


def test_an_unknown_workload_exits_2_naming_the_option(tmp_path):
    res = invoke("bench", "latency", "--backend", "cpu", "--workloads", "dot,nope", "--out", tmp_path / "out")
    assert res.code == 2 and "--workloads" in res.stderr and "Traceback" not in res.output
