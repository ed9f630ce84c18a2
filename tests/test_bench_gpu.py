"""``mgpu bench`` on one GPU at tiny sizes: every suite's GPU path, the alternatives that
need CUDA (CuPy, cuBLASXt, dask.array on dask-cuda's cluster) included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import invoke

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


def _record(out: Path, suite: str, *args: str) -> dict[str, Any]:
    res = invoke("bench", suite, "--backend", "cuda", "--sizes", "tiny", "--out", out, *args)
    assert res.code == 0, res.output
    record = json.loads((out / f"{suite}.json").read_text())
    assert record["options"]["backend"] == "cuda" and record["machine"]["gpus"]
    for entry in record["runs"]:
        assert entry["result"]["status"] == "ok" and entry["result"]["backend"] == "cuda", entry
    return record


def test_suite_on_one_gpu(tmp_path):
    record = _record(tmp_path, "suite", "--devices", "1")
    names = {e["name"] for e in record["runs"]}
    assert {"matmul-tf32", "matmul-float32-distributed", "dot-float32", "mandelbrot-float64"} <= names
    assert all(r["roofline_fraction"] for r in record["summary"])


def test_scale_spreads_each_job_over_workers_sharing_one_gpu(tmp_path):
    record = _record(tmp_path, "scale", "--devices", "1", "--workers-per-device", "2")
    assert record["options"]["workers_per_device"] == [1, 2]
    rows = {(r["name"], r["workers_per_device"]): r for r in record["summary"]}
    assert {w for _, w in rows} == {1, 2} and len(rows) == 6
    for (name, workers), row in rows.items():
        assert row["ok"] == row["runs"] == 1 and row["overhead_s"] is not None
        assert row["compute_vs_one_worker"] == (
            1.0 if workers == 1 else rows[name, 2]["compute_s"] / rows[name, 1]["compute_s"]
        )
    # Two workers, one GPU: each result counts the GPU once.
    shared = [e["result"] for e in record["runs"] if e.get("workers_per_device") == 2]
    assert shared and all([d["workers"] for d in r["devices"]] == [2] for r in shared)


def test_peers_on_one_gpu(tmp_path):
    record = _record(tmp_path, "peers", "--devices", "1", "--protocol", "tcp")
    alts = record["alternatives"]
    assert alts["cupy-1gpu"]["status"] == "ok", alts["cupy-1gpu"]
    assert {f["name"] for f in alts["cupy-1gpu"]["figures"]} == {"matmul", "matmul-tf32", "matmul-float64", "dot"}
    assert alts["cublasxt"]["1"]["status"] == "ok", alts["cublasxt"]
    configs = [f["config"] for f in alts["cublasxt"]["1"]["figures"]]
    assert configs == ["pinned", "pinned-block-16384", "pinned-block-4096", "pinning", "pageable"]  # no files
    assert alts["dask-array-tcp"]["1"]["status"] == "ok", alts["dask-array-tcp"]
    assert {r["alternative"] for r in record["comparison"]} == {"dask-array-tcp", "cupy-1gpu", "cublasxt"}


def test_outofcore_on_one_gpu(tmp_path):
    record = _record(tmp_path / "out", "outofcore", "--devices", "1", "--scratch", str(tmp_path))
    matmul = record["runs"][0]
    assert matmul["name"] == "outofcore-matmul-1024-streamed"
    assert matmul["result"]["pcie"]["bytes"] > 0
    xt = record["alternatives"]["cublasxt"]["1024/1"]  # side / devices
    assert xt["status"] == "ok", xt
    figures = {f["config"]: f for f in xt["figures"]}
    assert set(figures) == {"pinned", "pinned-block-16384", "pinned-block-4096", "pinning", "pageable", "same-work"}
    parts = figures["same-work"]["parts"]
    assert figures["same-work"]["seconds"] == pytest.approx(sum(parts.values()))
    assert set(matmul["vs"]) == set(figures) and all(v["speedup"] > 0 for v in matmul["vs"].values())
    row = next(r for r in record["summary"] if r["name"] == matmul["name"])
    assert set(row["vs_cublasxt"]) == set(figures)
    assert not list(tmp_path.rglob("cublasxt-c.npy"))  # the same work's C is gone


def test_alloc_on_a_gpu(tmp_path):
    record = _record(tmp_path, "alloc", "--iterations", "2")
    assert record["alloc"]["status"] == "ok" and record["alloc"]["sizes"] == [64 << 10, 1 << 20]
