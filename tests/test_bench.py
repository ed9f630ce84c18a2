"""``mgpu bench SUITE`` on CPU workers at tiny sizes: each suite runs and writes one record
of the shared schema; a wrong option exits 2 naming it and writes nothing; the pieces the
suites compute (device counts, efficiency, comparisons, job seconds) are right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import invoke

import mgpu
from mgpu.bench import SUITES
from mgpu.bench.cli import _command
from mgpu.bench.harness import SCHEMA, BenchInputError, job_seconds, parse_devices
from mgpu.bench.peers import compare
from mgpu.bench.scale import with_scaling

ROOT = Path(__file__).resolve().parents[1]


def check_record(out: Path, suite: str) -> dict[str, Any]:
    """The record in ``out``, checked against the schema every suite shares."""
    record = json.loads((out / f"{suite}.json").read_text())
    assert record["schema"] == SCHEMA and record["suite"] == suite
    assert record["command"][:3] == ["mgpu", "bench", suite] and "--out" in record["command"]
    assert record["wall_s"] > 0 and record["date"].endswith("+00:00")
    machine = record["machine"]
    assert machine["cpus"] >= 1 and machine["memory"] > 0 and machine["packages"]["mgpu"] == mgpu.__version__
    assert isinstance(machine["gpus"], list)
    assert record["options"]["backend"] == "cpu"
    assert {"runs", "alternatives", "summary"} <= set(record)
    for entry in record["runs"]:
        assert {"name", "devices", "repeat", "job", "overrides", "result"} <= set(entry)
        result = mgpu.Result.model_validate(entry["result"])  # the job's own Result, whole
        assert result.status == "ok" and result.verify.passed is True
        assert result.backend == "cpu" and len(result.devices) == entry["devices"]
        # The job as written, with its overrides, is the job that ran.
        assert entry["job"]["params"].items() <= result.job["params"].items()
        assert f"cluster.devices={entry['devices']}" in entry["overrides"]
    assert sorted(p.name for p in out.iterdir()) == [f"{suite}.json"]  # the record alone
    return record


# -- each suite on CPU workers ----------------------------------------------------------


def test_suite_runs_every_job_against_its_roofline(tmp_path):
    # A job file of the user's runs beside the suite's own, at the size it is written for.
    mine = tmp_path / "jobs" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text("workload: dot\nparams: {n: 12345, seed: 3}\ncluster: {devices: 2}\n")
    out = tmp_path / "out"
    res = invoke(
        "bench", "suite", "--backend", "cpu", "--devices", "1", "--cached-ceilings", "--job", mine, "--out", out
    )
    assert res.code == 0, res.output
    record = check_record(out, "suite")
    names = [e["name"] for e in record["runs"]]
    assert names == [
        "matmul-float32",
        "matmul-float64",
        "dot-float32",
        "mandelbrot-float32",
        "mandelbrot-float64",
        "mine",
    ]
    assert record["command"][-2:] == ["--job", str(mine)]
    theirs = record["runs"][-1]["result"]
    assert theirs["job"]["params"]["n"] == 12345 and theirs["job"]["params"]["seed"] == 3
    assert len(theirs["devices"]) == 1  # the suite's device count, not the file's
    assert record["options"]["sizes"] == "tiny" and record["options"]["device_counts"] == [1]
    by_name = {e["name"]: e["result"] for e in record["runs"]}
    assert by_name["matmul-float64"]["job"]["params"]["m"] == 256
    assert by_name["matmul-float64"]["job"]["params"]["dtype"] == "float64"
    assert by_name["mandelbrot-float32"]["job"]["params"]["width"] == 256
    # One row per job; with one run its median is that run's figure.
    rows = {r["name"]: r for r in record["summary"]}
    assert set(rows) == set(names)
    for name, r in by_name.items():
        assert rows[name]["throughput"] == r["throughput"]["value"] and rows[name]["unit"] == r["throughput"]["unit"]
        assert rows[name]["roofline_fraction"] == r["roofline"]["fraction"]
        # What submit expected of the tiles, beside what they took.
        assert rows[name]["expected_s"] == r["estimate"]["seconds"] > 0
        assert rows[name]["measured_over_expected"] == pytest.approx(r["compute_s"] / r["estimate"]["seconds"])
    assert "matmul-float32" in res.stderr and "share of roofline" in res.stderr and "took / expected" in res.stderr
    assert record["alternatives"] == {}


def test_outofcore_reads_the_inputs_from_files_and_cleans_up(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "out"
    res = invoke("bench", "outofcore", "--backend", "cpu", "--devices", "2", "--scratch", scratch, "--out", out)
    assert res.code == 0, res.output
    record = check_record(out, "outofcore")
    names = [e["name"] for e in record["runs"]]
    stored = [f"outofcore-matmul-1024-distributed-{layout}" for layout in ("zarr", "zarr-square", "zarr-zstd")]
    assert names == ["outofcore-matmul-1024-distributed", *stored, "outofcore-dot"]
    matmul, dot = record["runs"][0]["result"], record["runs"][-1]["result"]
    # The same job from Zarr stores, C into a store, set against the .npy job.
    for entry in record["runs"][1:4]:
        r, vs = entry["result"], entry["vs_npy"]
        assert r["status"] == "ok" and r["job"]["params"]["input"]["a"].endswith("a.zarr")
        assert r["outputs"][0].endswith("c.zarr") and vs["npy_s"] == pytest.approx(job_seconds(matmul))
        assert vs["rate_ratio"] == pytest.approx(vs["npy_s"] / job_seconds(r))
    zstd = record["runs"][3]
    assert zstd["store"]["zstd"] and zstd["vs_decode"]["decode_gbps"] == zstd["store"]["decode"]["gbps"] > 0
    assert matmul["job"]["params"]["operands"] == "distributed" and matmul["job"]["params"]["m"] == 1024
    assert matmul["job"]["params"]["input"]["a"].startswith(str(scratch))
    assert matmul["job"]["cluster"]["memory_limit"] == 24 << 20
    assert matmul["outputs"] == [matmul["job"]["params"]["output"]]  # C, written by the workers
    assert dot["job"]["params"]["n"] == 2_000_000 and dot["plan"]["tiles"] >= 2
    assert record["alternatives"]["cublasxt"]["status"].startswith("skipped: cuBLASXt needs GPUs")
    assert "cublasxt: skipped" in res.stderr
    assert list(scratch.iterdir()) == []  # the inputs and C are gone


def test_scale_sets_each_count_against_the_fewest(tmp_path):
    res = invoke("bench", "scale", "--backend", "cpu", "--devices", "1,2", "--out", tmp_path)
    assert res.code == 0, res.output
    record = check_record(tmp_path, "scale")
    assert record["options"]["device_counts"] == [1, 2]
    assert sorted((e["name"], e["devices"]) for e in record["runs"]) == sorted(
        (name, n) for name in ("matmul-float32", "dot-float32", "mandelbrot-float32") for n in (1, 2)
    )
    rows = {(r["name"], r["devices"]): r for r in record["summary"]}
    for name in ("matmul-float32", "dot-float32", "mandelbrot-float32"):
        one, two = rows[(name, 1)], rows[(name, 2)]
        assert one["efficiency"] == pytest.approx(1.0)
        assert two["efficiency"] == pytest.approx(two["throughput"] / (2 * one["throughput"]))


def test_peers_runs_dask_array_beside_mgpu(tmp_path):
    res = invoke("bench", "peers", "--backend", "cpu", "--devices", "2", "--out", tmp_path)
    assert res.code == 0, res.output
    record = check_record(tmp_path, "peers")
    dask_array = record["alternatives"]["dask-array-tcp"]["2"]
    assert dask_array["status"] == "ok", dask_array
    figures = {f["name"]: f for f in dask_array["figures"]}
    assert figures["matmul"]["shape"] == [256, 256] and figures["matmul"]["unit"] == "TFLOP/s"
    assert figures["dot"]["unit"] == "GB/s" and len(figures["dot"]["samples"]) == 3
    for key in ("cupy-1gpu", "cublasxt"):
        assert record["alternatives"][key]["status"].startswith("skipped: ")
    rows = {r["job"]: r for r in record["comparison"]}
    assert set(rows) == {"matmul-float32", "dot-float32"}
    mm = rows["matmul-float32"]
    assert mm["alternative"] == "dask-array-tcp" and mm["value"] == figures["matmul"]["value"]
    assert mm["mgpu_over_alternative"] == pytest.approx(mm["mgpu"] / mm["value"])


# -- wrong options ----------------------------------------------------------------------

BAD = [
    (["suite", "--devices", "0"], "--devices"),
    (["suite", "--devices", "1,x"], "--devices"),
    (["suite", "--devices", "999"], "--devices: 999 asked for"),
    (["scale", "--sizes", "huge"], "--sizes"),
    (["peers", "--backend", "gpu"], "--backend"),
    (["outofcore", "--repeats", "0"], "--repeats"),
    (["suite", "--protocol", "pigeon"], "--protocol"),
    (["scale", "--nope"], "--nope"),
    (["scale", "--workers-per-device", "0"], "--workers-per-device"),
    (["scale", "--workers-per-device", "2"], "--workers-per-device: several workers per device is for GPUs"),
    (["suite", "--set", "params.m=-1"], "params.m"),
    (["suite", "--job", "no-such-job.yaml"], "--job: cannot read 'no-such-job.yaml'"),
    (["peers", "--set", "cluster.allocator=magic"], "cluster.allocator"),
]


@pytest.mark.parametrize(("args", "named"), BAD)
def test_a_wrong_option_exits_2_naming_it(tmp_path, args, named):
    out = tmp_path / "out"
    backend = [] if "--backend" in args else ["--backend", "cpu"]
    res = invoke("bench", *args, *backend, "--out", out)
    assert res.code == 2, res.output
    assert named in res.stderr and "Traceback" not in res.output
    assert not out.exists() or list(out.iterdir()) == []  # nothing written


def test_cuda_without_a_gpu_is_refused(tmp_path, no_gpu):
    res = invoke("bench", "suite", "--backend", "cuda", "--out", tmp_path)
    assert res.code == 2 and "--backend: cuda asked for, but no GPU is visible" in res.stderr


def test_an_existing_record_is_kept_unless_forced(tmp_path):
    (tmp_path / "scale.json").write_text("{}")
    res = invoke("bench", "scale", "--backend", "cpu", "--out", tmp_path)
    assert res.code == 2 and "--out:" in res.stderr and "--force" in res.stderr
    assert (tmp_path / "scale.json").read_text() == "{}"


def test_the_real_command_lists_the_suites_and_names_a_wrong_option(tmp_path):
    run = [sys.executable, "-m", "mgpu", "bench"]
    proc = subprocess.run([*run, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for suite in SUITES:
        assert f"  {suite} " in proc.stdout
    proc = subprocess.run(
        [*run, "suite", "--devices", "two", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--devices" in proc.stderr and "Traceback" not in proc.stderr


# -- the pieces -------------------------------------------------------------------------


def test_parse_devices():
    assert parse_devices("all") is None
    assert parse_devices("2") == [2] and parse_devices("4, 1,2,2") == [1, 2, 4]
    for bad in ("0", "-1", "x", "", "1,,2"):
        with pytest.raises(BenchInputError, match="--devices"):
            parse_devices(bad)


def _row(name: str, devices: int, throughput: float | None) -> dict[str, Any]:
    return {"name": name, "devices": devices, "throughput": throughput}


def test_efficiency_against_the_fewest_devices_that_ran():
    rows = with_scaling([_row("a", 4, 30.0), _row("a", 1, None), _row("a", 2, 20.0), _row("b", 1, 5.0)])
    got = {(r["name"], r["devices"]): r["efficiency"] for r in rows}
    # a's 1-device run failed: its base is 2 devices at 20, so 4 devices ideally make 40.
    # b ran on one device count alone, which scales nothing.
    assert got == {("a", 4): pytest.approx(0.75), ("a", 1): None, ("a", 2): 1.0, ("b", 1): None}


def test_workers_per_gpu_set_their_compute_against_one_worker_and_scale_apart():
    def row(devices: int, workers: int, throughput: float, compute_s: float) -> dict[str, Any]:
        return {**_row("a", devices, throughput), "workers_per_device": workers, "compute_s": compute_s}

    rows = with_scaling([row(1, 1, 10.0, 2.0), row(1, 4, 9.8, 2.04), row(2, 1, 19.0, 1.05), row(2, 4, 18.0, 1.1)])
    got = {(r["devices"], r["workers_per_device"]): r for r in rows}
    assert got[1, 4]["compute_vs_one_worker"] == pytest.approx(1.02)
    assert got[2, 4]["compute_vs_one_worker"] == pytest.approx(1.1 / 1.05)
    # Efficiency sets device counts against each other with as many workers on each device.
    assert got[2, 1]["efficiency"] == pytest.approx(0.95) and got[2, 4]["efficiency"] == pytest.approx(18 / 19.6)


def test_jobs_of_one_layout_on_one_cluster_leave_the_start_up_to_the_first(tmp_path):
    from mgpu.bench.harness import Options, run_jobs

    opts = Options(suite="scale", out=tmp_path, repeats=2)
    runs = run_jobs(opts, [("dot", {"workload": "dot", "params": {"n": 1000}})], "cpu", [1], one_cluster=True)
    assert [e["repeat"] for e in runs] == [0, 1] and all(e["result"]["verify"]["passed"] for e in runs)
    first, second = (e["result"]["startup"] for e in runs)
    # The second job found the cluster up (its cluster_s: the round trip that found the
    # worker, no start) and the worker warm for it.
    assert 0 < second["cluster_s"] < first["cluster_s"]
    assert first["warmups"] == 1 and second["warmups"] == 0


def test_compare_sets_each_job_against_the_same_work_on_the_same_devices():
    summary = [_row("matmul-float32", 2, 100.0), _row("dot-float32", 2, 50.0), _row("mandelbrot-float32", 2, 9.0)]
    fig = [{"name": "matmul", "value": 25.0, "unit": "TFLOP/s"}, {"name": "dot", "value": 100.0, "unit": "GB/s"}]
    alternatives = {
        "dask-array-tcp": {
            "1": {"status": "ok", "figures": [{"name": "matmul", "value": 1.0, "unit": "TFLOP/s"}]},
            "2": {"status": "ok", "figures": fig},
        },
        "cupy-1gpu": {"status": "ok", "figures": fig[:1]},
        "cublasxt": {"status": "skipped: no GPU"},
    }
    rows = {(r["job"], r["alternative"]): r for r in compare(summary, alternatives)}
    assert set(rows) == {
        ("matmul-float32", "dask-array-tcp"),
        ("dot-float32", "dask-array-tcp"),
        ("matmul-float32", "cupy-1gpu"),
    }
    assert rows[("matmul-float32", "dask-array-tcp")]["mgpu_over_alternative"] == 4.0  # not the 1-device figure
    assert rows[("dot-float32", "dask-array-tcp")]["mgpu_over_alternative"] == 0.5
    assert rows[("matmul-float32", "cupy-1gpu")]["alternative_devices"] == 1


def test_job_seconds_leave_out_the_start_up():
    r = {
        "wall_s": 10.0,
        "compute_s": 4.0,
        "startup": {"cluster_s": 3.0, "ceilings_s": 1.0, "plan_s": 0.5, "warmup_s": 0.5, "first_tile_s": 2.0},
    }
    assert job_seconds(r) == pytest.approx(5.0)
    assert job_seconds({"wall_s": 10.0, "compute_s": 4.0}) == 4.0


def test_the_recorded_command_writes_every_option_out():
    cmd = _command(
        "suite", {"out": Path("o"), "backend": "cpu", "devices": [1, 2], "sets": ["a=1", "b=2"], "force": False}
    )
    assert cmd == [
        "mgpu",
        "bench",
        "suite",
        "--out",
        "o",
        "--backend",
        "cpu",
        "--devices",
        "1,2",
        "--set",
        "a=1",
        "--set",
        "b=2",
    ]
    assert _command("scale", {"devices": None, "force": True})[3:] == ["--devices", "all", "--force"]


def test_outofcore_refuses_a_scratch_folder_too_small(tmp_path, monkeypatch):
    from collections import namedtuple

    from mgpu.bench import outofcore

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(outofcore.shutil, "disk_usage", lambda path: usage(10**6, 0, 10**6))
    res = invoke(
        "bench", "outofcore", "--backend", "cpu", "--devices", "2", "--scratch", tmp_path, "--out", tmp_path / "out"
    )
    assert res.code == 2 and "--scratch: the largest case's files take 0.016 GB" in res.stderr, res.output
    assert list(tmp_path.iterdir()) == []  # no input written, no record
