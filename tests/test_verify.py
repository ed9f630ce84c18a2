"""A corrupted tile fails the job: every workload's check catches the fault that a test
plugin on the workers puts in one tile's answer (tests/faults.py), exit 1, and no output
is kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import invoke, start_local_cluster, write_job
from distributed import Client
from faults import SpoilTile, spoiled

from mgpu.worker import kernels

CORRUPT_TILE = 1


@pytest.fixture(scope="module")
def faulty_scheduler() -> Any:
    """A LocalCluster whose workers corrupt tile 1 of every job."""
    cluster = start_local_cluster()
    try:
        with Client(cluster) as client:
            client.register_plugin(SpoilTile(CORRUPT_TILE))
        yield cluster.scheduler_address
    finally:
        cluster.close()


JOBS = {
    "matmul": lambda t: {
        "workload": "matmul",
        "params": {"m": 8, "n": 10, "k": 3, "output": str(t / "c.npy")},
        "tiling": {"m": 4, "n": 5},
    },
    "matmul-k-split": lambda t: {
        "workload": "matmul",
        "params": {"m": 37, "n": 41, "k": 43, "dtype": "float64", "output": str(t / "c.npy")},
        "tiling": {"m": 10, "n": 20, "k": 11},
    },
    "matmul-distributed": lambda t: {
        "workload": "matmul",
        "params": {"m": 9, "n": 11, "k": 5, "operands": "distributed", "output": str(t / "c.npy")},
    },
    "dot": lambda t: {"workload": "dot", "params": {"n": 100_003}},
    "mandelbrot": lambda t: {
        "workload": "mandelbrot",
        "params": {
            "width": 33,
            "height": 29,
            "max_iter": 40,
            "output": {"npy": str(t / "m.npy"), "png": str(t / "m.png")},
        },
    },
}


@pytest.mark.parametrize("name", list(JOBS))
def test_corrupted_tile_fails_the_job(tmp_path, faulty_scheduler, name):
    job = write_job(tmp_path / "job.yaml", JOBS[name](tmp_path))
    out_json = tmp_path / "result.json"
    res = invoke("submit", job, "--scheduler", faulty_scheduler, "--json", out_json, "-q")
    assert "Traceback" not in res.output
    assert res.code == 1, res.output
    assert "verification failed" in res.stderr
    data = json.loads(out_json.read_text())
    assert data["status"] == "failed"
    assert data["verify"]["passed"] is False
    assert data["verify"]["failed_tiles"] == [CORRUPT_TILE]
    assert data["plan"]["tiles"] >= 2
    assert data["outputs"] == []
    # Nothing under the outputs' names, and no temporary files left behind.
    assert sorted(os.listdir(tmp_path)) == ["job.yaml", "result.json"]


def test_the_fault_is_real_when_verification_is_off(tmp_path, faulty_scheduler):
    """With --no-verify the same corruption goes through: the check above is what caught it."""
    out = tmp_path / "c.npy"
    job = write_job(tmp_path / "job.yaml", JOBS["matmul"](tmp_path))
    res = invoke(
        "submit", job, "--scheduler", faulty_scheduler, "--no-verify", "-q", "--json", tmp_path / "result.json"
    )
    assert res.code == 0, res.output
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["status"] == "ok" and data["verify"]["passed"] is None
    a = kernels.random_block(np, seed=0, operand=0, rows=(0, 8), cols=(0, 3), total_cols=3, dtype="float32")
    b = kernels.random_block(np, seed=0, operand=1, rows=(0, 3), cols=(0, 10), total_cols=10, dtype="float32")
    diff = np.load(out).astype(np.float64) - a.astype(np.float64) @ b.astype(np.float64)
    # Tiles of 4 x 5 in row-major order: tile 1 is rows 0-3, columns 5-9, each off by one.
    wrong = np.argwhere(np.abs(diff) > 1e-5)
    assert wrong.tolist() == [[r, c] for r in range(4) for c in range(5, 10)]
    assert diff[:4, 5:] == pytest.approx(np.ones((4, 5)), abs=1e-5)


def test_healthy_cluster_passes_the_same_job(tmp_path, scheduler):
    """The control: without the fault the same job passes and keeps its output."""
    job = write_job(tmp_path / "job.yaml", JOBS["matmul"](tmp_path))
    res = invoke("submit", job, "--scheduler", scheduler, "-q", "--json", tmp_path / "result.json")
    assert res.code == 0, res.output
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["verify"]["passed"] is True and data["verify"]["failed_tiles"] == []
    assert Path(data["outputs"][0]).is_file()


class _Stream:
    def __init__(self, log: list[str]) -> None:
        self.log, self.ptr = log, 1

    def synchronize(self) -> None:
        self.log.append("wait for the stream")

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _OnDevice:
    """A device array whose copy back notes when it ran."""

    def __init__(self, log: list[str], value: np.ndarray) -> None:
        self.log, self.value = log, value

    def get(self, stream: Any = None) -> np.ndarray:
        self.log.append("copy")
        return self.value


def test_fetches_from_a_gpu_wait_for_the_stream_before_they_copy(monkeypatch):
    # A copy that waits for the GPU itself holds up the other threads' CUDA calls (the
    # Mandelbrot bands were queued one at a time); the wait must come first, then the copy.
    import types

    from mgpu.worker.device import Device, DeviceFacts

    log: list[str] = []
    stream = _Stream(log)
    fake = types.SimpleNamespace(__name__="cupy", cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    assert kernels.to_host(fake, _OnDevice(log, np.arange(3))).tolist() == [0, 1, 2]
    assert log == ["wait for the stream", "copy"]
    log.clear()
    dev = Device("cuda", fake, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: stream)
    assert dev.to_host(_OnDevice(log, np.ones(4))).sum() == 4 and dev.bytes_d2h == 32
    assert log == ["wait for the stream", "copy"]


@pytest.mark.parametrize("operands", ["per-tile", "streamed"])
def test_a_product_of_same_signed_operands_passes_its_check_by_a_wide_margin(tmp_path, operands):
    # Operands in [0, 1): C's entries all share a sign. With a check vector of both signs,
    # A·(B·r) cancelled down to the scale of sum(r) and a correct product came within a
    # few times of the tolerance, past it for some draws.
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.tile import run_tile
    from mgpu.workloads.matmul import Matmul, MatmulParams

    rng = np.random.default_rng(0)
    for name, shape in (("a", (256, 1024)), ("b", (1024, 256))):
        np.save(tmp_path / f"{name}.npy", rng.random(shape, dtype=np.float32))
    files = {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    job = Matmul(MatmulParams(input=files, operands=operands))
    for tile in job.plan({"w": dev.facts}, 1 << 30, {}).tiles:
        record = run_tile(job, dev, tile)
        assert record.verify_ok is True and record.verify_error < job.tolerance() / 20, record.verify_error
        bad = run_tile(spoiled(job), dev, tile)
        assert bad.verify_ok is False
