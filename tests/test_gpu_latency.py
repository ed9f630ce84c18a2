"""On GPUs: Mandelbrot's check runs on the device and fails a misplaced band; a cluster of
GPU workers that ``mgpu cluster up`` started serves a submit and ``down`` leaves nothing;
``mgpu bench latency`` runs its CuPy scripts beside mgpu's jobs.

Run on a GPU machine with ``pytest -m gpu``; skipped where CuPy or a GPU is missing.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")

from conftest import invoke, write_job  # noqa: E402
from test_client_imports import gpu_modules_after  # noqa: E402
from test_cluster_up import _group, _mgpu  # noqa: E402

from mgpu.tiling import Tile  # noqa: E402
from mgpu.worker.tile import TileContext, run_tile  # noqa: E402
from mgpu.workloads.mandelbrot import Mandelbrot, MandelbrotParams  # noqa: E402


def test_the_mandelbrot_check_counts_again_on_the_gpu_and_fails_a_misplaced_band():
    from mgpu.worker.runtime import _cuda_device

    dev = _cuda_device()
    params = MandelbrotParams(width=4096, height=512, max_iter=500)
    band = Tile(1, {"rows": (64, 192)})
    good = run_tile(Mandelbrot(params), dev, band)
    assert good.verify_ok is True and good.verify_error == 0.0 and good.verify_s > 0

    class Misplaced(Mandelbrot):
        def run(self, ctx: TileContext, tile: Tile) -> Any:
            answer = super().run(ctx, tile)
            answer.counts = super().run(ctx, Tile(2, {"rows": (65, 193)})).counts
            return answer

    bad = run_tile(Misplaced(params), dev, band)
    assert bad.verify_ok is False and bad.verify_error > 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_checks_own_points_match_the_bands_axes_across_a_wide_image(dtype):
    # The check makes its points in its kernel from the pixel indices, the band's kernel
    # reads axes made on the host: a correct band passes only if the two agree bit for bit.
    from mgpu.worker.runtime import _cuda_device

    dev = _cuda_device()
    params = MandelbrotParams(width=65536, height=4096, xmin=-2.25, xmax=0.75, ymin=-1.5, ymax=1.5, dtype=dtype)
    for index, rows in enumerate([(0, 64), (1000, 1100), (4000, 4096)]):
        record = run_tile(Mandelbrot(params), dev, Tile(index, {"rows": rows}))
        assert record.verify_ok is True and record.verify_error == 0.0


def test_a_submit_joins_the_gpu_cluster_up_started_and_down_leaves_no_process(tmp_path):
    cache = tmp_path / "cache"
    up = _mgpu(cache, "cluster", "up", "--backend", "cuda", "--devices", "1", "--no-dashboard", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    record = json.loads((cache / "cluster.json").read_text())
    try:
        assert record["backend"] == "cuda" and record["workers"] == 1
        job = write_job(tmp_path / "job.yaml", {"workload": "mandelbrot", "params": {"width": 2048, "height": 2048}})
        out = tmp_path / "result.json"
        for _ in range(2):  # the second finds the worker warm
            submit = _mgpu(cache, "submit", job, "--json", out)
            assert submit.returncode == 0, submit.stdout + submit.stderr
            assert f"joining the running cluster at {record['address']}" in submit.stdout
        result = json.loads(out.read_text())
        assert result["backend"] == "cuda" and result["verify"]["passed"] is True
        assert result["verify"]["seconds"] > 0
        # The client of a GPU cluster imports no GPU library, though every one is installed here.
        env = {**os.environ, "DASK_MGPU__CACHE_DIR": str(cache)}
        code = f"import sys\nfrom mgpu.cli import main\nsys.argv = ['mgpu', 'submit', {str(job)!r}, '-q']\n"
        code += "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code"
        assert gpu_modules_after(code, env) == []
    finally:
        down = _mgpu(cache, "cluster", "down")
    assert down.returncode == 0 and _group(record["pid"]) == []


def test_the_latency_suite_runs_its_cupy_scripts_beside_the_jobs(tmp_path):
    out = tmp_path / "out"
    res = invoke("bench", "latency", "--backend", "cuda", "--sizes", "tiny", "--out", out)
    assert res.code == 0, res.output
    record = json.loads((out / "latency.json").read_text())
    assert all(r["status"] == "ok" for r in record["runs"]), [r for r in record["runs"] if r["status"] != "ok"]
    for name, alt in record["alternatives"].items():
        assert alt["status"] == "ok" and "CuPy" in alt["what"], (name, alt)
    for row in record["summary"]:
        assert row["running_over_script"] and row["verify_share"] is not None
