"""benchmarks/outofcore.py, benchmarks/cublasxt.py and benchmarks/gpus_from_files.py on CPU:
the bound and share arithmetic, cuBLASXt's row-major -> column-major argument mapping
checked with NumPy, the host-routes probe's tiles, and one real run of the benchmark on CPU
workers (cuBLASXt, the GPU ceilings and the host routes skipped)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import gpu_count

from mgpu.spec import load_job

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"mgpu_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


oc = _load("outofcore")
xt = _load("cublasxt")
routes = _load("gpus_from_files")


# -- the arithmetic ------------------------------------------------------------------------


def test_bound_compute_bound():
    # 1e15 flop on 2 GPUs of 50 TFLOP/s: 10 s; 1e11 bytes over 2 x 50 GB/s: 1 s.
    b = oc.outofcore_bound(1e15, 1e11, 2, 50.0, 50.0)
    assert b["bound_by"] == "compute"
    assert b["seconds"] == pytest.approx(10.0) and b["compute_s"] == pytest.approx(10.0)
    assert b["pcie_s"] == pytest.approx(1.0)
    assert b["tflops"] == pytest.approx(100.0)


def test_bound_pcie_bound():
    # 1e13 flop: 0.1 s of compute; 1e12 bytes over 2 x 50 GB/s: 10 s, which sets the bound.
    b = oc.outofcore_bound(1e13, 1e12, 2, 50.0, 50.0)
    assert b["bound_by"] == "pcie"
    assert b["seconds"] == pytest.approx(10.0) and b["compute_s"] == pytest.approx(0.1)
    assert b["tflops"] == pytest.approx(1.0)  # 1e13 flop in 10 s


def test_bound_at_the_issue_size():
    # 49152³ float32 on 2 GPUs at 54 TFLOP/s and 55 GB/s each: compute-bound, 2.2 s.
    n = 49152
    flops, nbytes = oc.matmul_flops(n, n, n), oc.matmul_min_bytes(n, n, n, 4)
    assert nbytes == 28_991_029_248  # A, B and C of 9.66 GB each
    b = oc.outofcore_bound(flops, nbytes, 2, 54.0, 55.0)
    assert b["bound_by"] == "compute"
    assert b["seconds"] == pytest.approx(2 * n**3 / 108e12)
    assert b["pcie_s"] == pytest.approx(28_991_029_248 / 110e9)


def test_bound_with_a_missing_ceiling():
    assert oc.outofcore_bound(1e13, 1e12, 2, 50.0, None)["seconds"] == pytest.approx(0.1)
    assert oc.outofcore_bound(1e13, 1e12, 2, None, 50.0)["bound_by"] == "pcie"
    assert oc.outofcore_bound(1e13, 1e12, 2, None, None) is None


def test_shares_and_ratios():
    assert oc.share_of_bound(2.0, 2.5) == pytest.approx(0.8)
    assert oc.share_of_bound(None, 2.5) is None and oc.share_of_bound(2.0, None) is None
    assert oc.speedup(9.0, 3.0) == pytest.approx(3.0)  # cuBLASXt 9 s, mgpu 3 s: mgpu 3x
    d = oc.dot_share(8e9, 0.1, 2, 55.0)
    assert d["gbps"] == pytest.approx(80.0) and d["limit_gbps"] == pytest.approx(110.0)
    assert d["share"] == pytest.approx(80 / 110)
    assert oc.dot_share(8e9, 0.1, 2, None)["share"] is None


def test_byte_counts():
    assert oc.matmul_min_bytes(100, 300, 50, 4) == 4 * (100 * 50 + 50 * 300 + 100 * 300)
    # 4 x 3 tiles of 30 x 100 over C[100, 300]: A read 3 times, B 4 times, C written once.
    assert oc.tiled_matmul_bytes(100, 300, 50, 30, 100, 4) == 4 * (3 * 5000 + 4 * 15000 + 30000)
    # One tile is the minimum.
    assert oc.tiled_matmul_bytes(100, 300, 50, 100, 300, 4) == oc.matmul_min_bytes(100, 300, 50, 4)
    result = {"per_device": [{"bytes_h2d": 10, "bytes_d2h": 1}, {"bytes_h2d": 20, "bytes_d2h": 2, "bytes_d2d": 99}]}
    assert oc.pcie_bytes(result) == 33
    assert oc.pcie_bytes(None) is None


def test_default_dot_n_exceeds_the_budget_on_each_device():
    budget = 16 << 30
    n = oc.default_dot_n(budget, 2)
    assert n == 6_442_450_944
    assert 2 * 4 * n / 2 == pytest.approx(1.5 * budget)  # x and y per device: 1.5 budgets


def test_job_seconds_leaves_out_the_start_up():
    r = {
        "wall_s": 10.0,
        "compute_s": 4.0,
        "startup": {"cluster_s": 3.0, "ceilings_s": 1.0, "plan_s": 0.5, "warmup_s": 0.5, "first_tile_s": 2.0},
    }
    assert oc.job_seconds(r) == pytest.approx(5.0)
    assert oc.job_seconds({"wall_s": 10.0, "compute_s": 4.0}) == 4.0


def test_ceilings_from_a_result_and_from_this_run():
    # The roofline of a float32 matmul result on two GPUs, as mgpu writes it.
    result = {
        "roofline": {"limit": 102.38, "fraction": 1.0085, "basis": "2 x gemm_float32 measured on one device alone"}
    }
    per_gpu = result["roofline"]["limit"] / 2
    assert oc.result_ceiling(result, "gemm_float32") == pytest.approx(per_gpu)
    assert oc.result_ceiling(result, "h2d_pinned") is None
    measured = {"0": {"gemm_float32": 50.0, "h2d_pinned": 54.0}, "1": {"gemm_float32": 52.0, "h2d_pinned": 56.0}}
    picked = oc.pick_ceilings(result, measured)
    assert picked["gemm_float32"] == {"value": pytest.approx(per_gpu), "source": "mgpu result"}
    assert picked["h2d_pinned"] == {"value": pytest.approx(55.0), "source": "measured here (CuPy)"}
    with_map = {"ceilings": {"w0": {"h2d_pinned": 50.0}, "w1": {"h2d_pinned": 60.0}}}
    assert oc.result_ceiling(with_map, "h2d_pinned") == pytest.approx(55.0)
    assert oc.pick_ceilings(None, None)["gemm_float32"] == {"value": None, "source": None}


def test_best_runs_per_host_memory_kind():
    runs = [
        {"host": "pageable", "block_dim": 8192, "seconds": 9.0},
        {"host": "pageable", "block_dim": 4096, "seconds": 11.0},
        {"host": "pinned", "block_dim": 8192, "seconds": 4.0},
        {"host": "pinned", "block_dim": 4096, "seconds": 3.5},
    ]
    best = oc.best_runs(runs)
    assert best["pageable"]["block_dim"] == 8192 and best["pinned"]["block_dim"] == 4096
    assert oc.best_runs(None) == {}


def test_rel_max_error_and_sample_rows():
    want = np.array([[1.0, -4.0], [2.0, 0.5]])
    got = want + np.array([[0.0, 0.004], [0.0, 0.0]])
    assert oc.rel_max_error(got, want) == pytest.approx(0.001)
    rows = oc.sample_rows(1000)
    assert rows == sorted(set(rows)) and {0, 500, 999} <= set(rows)
    assert all(0 <= r < 1000 for r in rows)
    assert oc.sample_rows(1) == [0]


def _result(seconds_after_warmup: float, **extra):
    startup = {"cluster_s": 1.0, "ceilings_s": 0.5, "plan_s": 0.0, "warmup_s": 0.5, "first_tile_s": 0.1}
    return {
        "status": "ok",
        "backend": "cuda",
        "verify": {"passed": True, "max_rel_error": 1e-7},
        "wall_s": 2.0 + seconds_after_warmup,
        "compute_s": seconds_after_warmup / 2,
        "startup": startup,
        "roofline": {"limit": 100.0, "fraction": 0.5, "basis": "2 x gemm_float32 measured on one device alone"},
        "per_device": [{"bytes_h2d": 5_000_000, "bytes_d2h": 1_000_000}] * 2,
        **extra,
    }


def test_summary_of_a_gpu_run(capsys):
    # 1000³ float32 on 2 GPUs of 50 TFLOP/s and 50 GB/s: compute 2e9 / 1e14 = 2e-5 s, PCIe
    # 12e6 B / 1e11 B/s = 1.2e-4 s, so PCIe-bound at 1.2e-4 s.
    report = {
        "n": 1000,
        "dot_n": 1_000_000,
        "devices": [0, 1],
        "checks": {},
        "steps": {
            "ceilings": {
                "out": {
                    "per_gpu": {
                        "0": {"gemm_float32": 60.0, "h2d_pinned": 40.0},
                        "1": {"gemm_float32": 60.0, "h2d_pinned": 60.0},
                    }
                }
            },
            "mgpu-matmul": {"result": _result(2.4e-4)},
            "mgpu-matmul-per-tile": {"result": _result(4.8e-4, plan={"tile_shape": {"m": 500, "n": 250, "k": 1000}})},
            "mgpu-dot": {"result": _result(1e-4, value=2.0)},
            "reference": {"out": {"dot": 2.0}},
            "host-routes": {
                "out": {
                    "status": "measured",
                    "runs": [
                        {"method": "dma-only", "gbps": 200.0},
                        {"method": "copy-pread", "gbps": 90.0},
                        {"method": "copy-pread", "gbps": 100.0},
                        {"method": "kvikio", "gbps": 95.0},
                    ],
                }
            },
            "cublasxt": {
                "out": {
                    "status": "ran",
                    "runs": [
                        {"host": "pageable", "block_dim": 512, "seconds": 7.2e-4, "tflops": 2.78},
                        {"host": "pageable", "block_dim": 256, "seconds": 9e-4, "tflops": 2.2},
                        {"host": "pinned", "block_dim": 512, "seconds": 3.6e-4, "tflops": 5.56},
                    ],
                }
            },
        },
    }
    s = oc.summarize(report)
    assert s["ceilings"]["gemm_float32"] == {"value": 50.0, "source": "mgpu result"}  # 100 over 2 workers
    assert s["ceilings"]["h2d_pinned"] == {"value": 50.0, "source": "measured here (CuPy)"}
    mm = s["matmul"]
    assert mm["bound"]["bound_by"] == "pcie" and mm["bound"]["seconds"] == pytest.approx(1.2e-4)
    assert mm["mgpu"]["seconds"] == pytest.approx(2.4e-4)  # after the warm-up, not compute_s
    assert mm["mgpu"]["share_of_bound"] == pytest.approx(0.5)
    assert mm["mgpu"]["x_cublasxt"] == {"pageable": pytest.approx(3.0), "pinned": pytest.approx(1.5)}
    assert mm["per_tile"]["share_of_bound"] == pytest.approx(0.25)
    assert mm["cublasxt"]["pageable"]["block_dim"] == 512
    assert mm["cublasxt"]["pinned"]["share_of_bound"] == pytest.approx(1 / 3)
    # A read 4 times (n / 250), B twice (m / 500), C once.
    assert s["pcie"] == {
        "minimum": 12_000_000,
        "distributed": 12_000_000,
        "per_tile": 12_000_000,
        "per_tile_planned": 28_000_000,
        "dot": 12_000_000,
        "dot_minimum": 8_000_000,
    }
    assert s["dot"]["gbps"] == pytest.approx(80.0) and s["dot"]["share"] == pytest.approx(0.8)
    assert s["dot"]["rel_error_vs_float64"] == 0.0
    # The best of each host route; the dot against the faster of the file routes (not the DMA's).
    assert s["host_routes"] == {"dma-only": 200.0, "copy-pread": 100.0, "kvikio": 95.0}
    assert s["dot"]["share_of_host_route"] == pytest.approx(0.8)
    oc.print_table(s)
    shown = capsys.readouterr().out
    assert "pcie-bound" in shown and "cuBLASXt, pinned, block 512" in shown
    assert "3.00 pageable, 1.50 pinned" in shown and "80.0%" in shown
    assert "mgpu dot, share of the host's route" in shown and "host: file -> pinned (pread), no DMA" in shown
    assert "host: memory -> memory" not in shown  # not measured in this run


# -- cuBLASXt's arguments --------------------------------------------------------------------


def _column_major_gemm(args, ops: dict[str, np.ndarray], c_size: int) -> np.ndarray:
    """What BLAS gemm('N', 'N', m, n, k, 1, A, lda, B, ldb, 0, C, ldc) does to raw buffers.

    Element (i, j) of a column-major matrix with leading dimension ld is buffer[i + j * ld].
    """
    first, second = ops[args.first].reshape(-1), ops[args.second].reshape(-1)
    a = first.reshape(args.k, args.lda).T[: args.m, :]  # m x k
    b = second.reshape(args.n, args.ldb).T[: args.k, :]  # k x n
    c = np.full(c_size, np.nan)
    c.reshape(args.n, args.ldc).T[: args.m, :] = a @ b
    return c


@pytest.mark.parametrize("m,k,n", [(3, 5, 7), (7, 5, 3), (4, 4, 4), (1, 9, 2)])
def test_gemm_args_compute_the_row_major_product(m, k, n):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    args = xt.gemm_args(a.shape, b.shape)
    c = _column_major_gemm(args, {"a": a, "b": b}, m * n)
    np.testing.assert_allclose(c.reshape(m, n), a @ b, rtol=1e-12)  # read back row-major


def test_gemm_args_swap_the_operands():
    args = xt.gemm_args((3, 5), (5, 7))
    assert (args.m, args.n, args.k) == (7, 3, 5)
    assert (args.first, args.lda, args.second, args.ldb, args.ldc) == ("b", 7, "a", 5, 7)
    with pytest.raises(ValueError, match="columns must equal"):
        xt.gemm_args((3, 5), (4, 7))
    with pytest.raises(ValueError, match="2-D"):
        xt.gemm_args((3,), (3, 7))


def test_mapped_library_finds_libcublas_not_lt():
    maps = "\n".join(
        [
            "7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
            "7f10-7f20 r-xp 00000000 08:01 2 /opt/py/site-packages/nvidia/cu13/lib/libcublasLt.so.13",
            "7f20-7f30 r-xp 00000000 08:01 3 /opt/py/site-packages/nvidia/cu13/lib/libcublas.so.13",
            "7f30-7f40 rw-p 00000000 00:00 0 ",
            "7f40-7f50 rw-p 00000000 00:00 0 [heap]",
        ]
    )
    assert xt.mapped_library(maps) == "/opt/py/site-packages/nvidia/cu13/lib/libcublas.so.13"
    assert xt.mapped_library(maps.replace("libcublas.so.13", "libfoo.so")) is None


def test_cublasxt_imports_without_loading_and_checks_operands():
    assert xt._lib.cache_info().currsize == 0  # nothing opened at import
    err = xt.CublasXtError("cublasXtSgemm", 7)
    assert err.status == 7 and "CUBLAS_STATUS_INVALID_VALUE" in str(err)
    if gpu_count() == 0 and __import__("ctypes.util").util.find_library("cublas") is None:
        with pytest.raises(OSError, match="libcublas not found"):
            xt.xt_gemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), devices=(0,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_xt_gemm_on_one_gpu(dtype, tol):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((1000, 3000)).astype(dtype), rng.standard_normal((3000, 2000)).astype(dtype)
    c, seconds = xt.xt_gemm(a, b, devices=(0,), block_dim=512)
    assert c.shape == (1000, 2000) and c.dtype == dtype and seconds > 0
    assert oc.rel_max_error(c, a.astype(np.float64) @ b.astype(np.float64)) < tol
    with xt.CublasXt((0,), 768) as handle:
        assert handle.block_dim == 768


# -- the command ---------------------------------------------------------------------------------


def test_cli_rejects_bad_values():
    runner = CliRunner()
    res = runner.invoke(oc.main, ["out", "--only", "inputs,nope"])
    assert res.exit_code == 2 and "nope" in res.output and "mgpu-matmul-per-tile" in res.output
    res = runner.invoke(oc.main, ["out", "--budget", "lots"])
    assert res.exit_code == 2 and "--budget" in res.output
    res = runner.invoke(oc.main, ["out", "--devices", "0,x"])
    assert res.exit_code == 2 and "--devices" in res.output
    res = runner.invoke(oc.main, ["out", "--xt-host", "pageable,mapped"])
    assert res.exit_code == 2 and "--xt-host" in res.output


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "outofcore.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quick_run_on_cpu_workers(tmp_path, no_gpu):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    res = _run(
        [
            str(out),
            "--quick",
            "--n",
            "256",
            "--dot-n",
            "100000",
            "--budget",
            "2MiB",
            "--scratch",
            str(scratch),
            "--keep",
        ]
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mgpu matmul, operands distributed" in res.stdout and "skipped: no GPU" in res.stdout
    report = json.loads((out / "outofcore.json").read_text())
    steps = report["steps"]
    assert "mgpu-matmul-per-tile" not in steps  # --quick
    assert len(report["commands"]) == len(steps) and any(" -m mgpu submit " in c for c in report["commands"])
    result = steps["mgpu-matmul"]["result"]
    assert result["status"] == "ok" and result["verify"]["passed"] is True and result["backend"] == "cpu"
    assert result["job"]["params"]["operands"] == "distributed"
    assert steps["cublasxt"]["out"]["status"] == "skipped: no GPU"
    assert steps["ceilings"]["out"]["status"] == "skipped: no GPU"
    assert steps["host-routes"]["out"] == {"status": "skipped: no GPU", "runs": []}
    assert "x.npy" in steps["host-routes"]["cmd"] and "gpus_from_files.py" in steps["host-routes"]["cmd"]
    # The C mgpu wrote is A @ B of the files.
    a, b = np.load(scratch / "a.npy"), np.load(scratch / "b.npy")
    assert a.shape == b.shape == (256, 256) and a.dtype == np.float32
    assert oc.rel_max_error(np.load(scratch / "c.npy"), a.astype(np.float64) @ b.astype(np.float64)) < 1e-5
    assert report["checks"]["c"]["max_rel_error_vs_float64"] < 1e-5
    # The files hold mgpu's random operands of seed 0.
    from mgpu.kernels import random_block

    np.testing.assert_array_equal(
        a[3:5], random_block(np, seed=0, operand=0, rows=(3, 5), cols=(0, 256), total_cols=256, dtype="float32")
    )
    s = report["summary"]
    x, y = np.load(scratch / "x.npy"), np.load(scratch / "y.npy")
    assert s["dot"]["value"] == pytest.approx(float(x.astype(np.float64) @ y.astype(np.float64)), rel=1e-12)
    assert s["dot"]["gbps"] == pytest.approx(8 * 100000 / s["dot"]["seconds"] / 1e9)
    assert s["pcie"]["minimum"] == 3 * 4 * 256**2 and s["pcie"]["distributed"] == 0  # CPU workers copy nothing
    mm = s["matmul"]
    assert mm["mgpu"]["tflops"] == pytest.approx(2 * 256**3 / mm["mgpu"]["seconds"] / 1e12)
    assert mm["bound"]["bound_by"] == "compute"  # no pinned H2D rate on CPU workers
    assert mm["mgpu"]["share_of_bound"] == pytest.approx(mm["bound"]["seconds"] / mm["mgpu"]["seconds"])
    assert mm["cublasxt"] == {} and mm["cublasxt_status"] == "skipped: no GPU"
    assert mm["mgpu"]["x_cublasxt"] == {}
    # The job files are mgpu's own, valid, with the budget and devices asked for.
    job = load_job(out / "mgpu-matmul.yaml")
    assert job.cluster.memory_limit == 2 << 20 and job.cluster.devices == [0, 1]
    assert report["jobs"]["mgpu-matmul"] == (out / "mgpu-matmul.yaml").read_text()
    # Kept inputs of the same sizes are reused; without --keep they are removed at the end.
    res = _run([str(out), "--quick", "--n", "256", "--dot-n", "100000", "--scratch", str(scratch), "--only", "inputs"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((out / "outofcore.json").read_text())["steps"]["inputs"]["out"]["status"] == "reused"
    assert sorted(os.listdir(scratch)) == []


def test_the_host_routes_probe_moves_the_dot_jobs_tiles(tmp_path):
    # 1000 float32 of x and y under 2400 B per device: 300 elements of each a tile at most,
    # so each of 2 GPUs gets its half in 2 tiles at least.
    for name in "xy":
        np.save(tmp_path / f"{name}.npy", np.zeros(1000, np.float32))
    spans = routes.dot_spans(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), 2, 2400)
    assert len(spans) == 2 and all(len(per_gpu) >= 2 for per_gpu in spans)
    flat = [t for per_gpu in spans for t in per_gpu]
    assert flat[0][0] == 0 and flat[-1][1] == 1000  # in order, end to end, no gap or overlap
    assert all(a[1] == b[0] for a, b in pairwise(flat))
    assert all(2 * 4 * (hi - lo) <= 2400 for lo, hi in flat)
    assert spans[0][-1][1] == 500  # each GPU its contiguous half, as the job places them


def test_the_inputs_are_read_once_whole_after_they_are_written(tmp_path, monkeypatch):
    # The first read of a just-written file is slower; the inputs step pays it, untimed.
    sizes = {"a.npy": 10_007, "b.npy": 1, "x.npy": 2048}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(os.urandom(size))
    got: dict[str, int] = {}
    real = os.preadv

    def counted(fd: int, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        name = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[1]
        got[name] = got.get(name, 0) + n
        return n

    monkeypatch.setattr(oc.os, "preadv", counted)
    assert oc._read_once([tmp_path / n for n in sizes], threads=3, piece=1000) > 0
    assert got == sizes
