"""On GPUs: a cluster of GPU workers mgpu starts for a job ends at once once the job is
done (every worker process killed, none restarted, none left), with each worker
collecting garbage again once its runtime was made; a tensor-core matmul ceiling is timed
over as many GEMMs again after mgpu.ceilings.sustain of them back to back, float32's by a
median of a few.

Run on a GPU machine with ``pytest -m gpu``; skipped where CuPy or a GPU is missing.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")

import dask.config  # noqa: E402
from conftest import write_job  # noqa: E402
from test_ending import worker_children  # noqa: E402

import mgpu  # noqa: E402
import mgpu.cluster  # noqa: E402
from mgpu.ending import end_workers  # noqa: E402


def _state(dask_worker: Any = None) -> dict[str, Any]:
    import gc

    return {"pid": os.getpid(), "ppid": os.getppid(), "collecting": gc.isenabled(), "frozen": gc.get_freeze_count()}


class _Watch(mgpu.Events):
    def __init__(self) -> None:
        self.workers: list[dict[str, Any]] = []

    def cluster_ready(self, info: Any) -> None:
        self.workers = list(info.client.run(_state).values())


@pytest.mark.parametrize("allocator", ["pool", "async"])
def test_a_gpu_cluster_mgpu_started_is_ended_at_once_and_leaves_no_process(tmp_path, monkeypatch, allocator):
    ended: list[Any] = []

    def spy(cluster: Any, timeout: float) -> None:
        ended.append({name: n.process.process for name, n in cluster.workers.items()})
        end_workers(cluster, timeout)

    monkeypatch.setattr(mgpu.cluster, "end_workers", spy)
    job = write_job(
        tmp_path / "matmul.yaml",
        {
            "workload": "matmul",
            "params": {"m": 4096, "n": 4096, "k": 4096},
            "cluster": {"backend": "cuda", "devices": 1, "allocator": allocator, "dashboard": None},
        },
    )
    watch = _Watch()
    assert mgpu.run(job, events=watch).status == "ok"
    # The workers collected garbage again once their runtime (CuPy, RMM) was set up.
    assert [w["collecting"] for w in watch.workers] == [True]
    assert all(w["frozen"] > 10_000 for w in watch.workers)
    # Killed once the job was done, and nothing of the cluster is left.
    (processes,) = ended
    assert {p.exitcode for p in processes.values()} == {-9}
    assert worker_children() == []


def test_every_gemm_ceiling_is_timed_after_the_sustain_window_not_by_a_median(monkeypatch):
    from mgpu import roofline
    from mgpu.worker.runtime import _cuda_device

    calls: list[str] = []
    busy, median = roofline.keep_busy, roofline.median_seconds

    def spy_busy(dev: Any, fn: Any, seconds: float) -> int:
        made = busy(dev, fn, seconds)
        calls.append(f"busy {seconds}")
        return made

    def spy_median(dev: Any, fn: Any, *, first: bool = True) -> float:
        calls.append("median")
        return median(dev, fn, first=first)

    monkeypatch.setattr(roofline, "keep_busy", spy_busy)
    monkeypatch.setattr(roofline, "median_seconds", spy_median)
    dev = _cuda_device()
    with dask.config.set({"mgpu.ceilings.sustain": "0.2s", "mgpu.ceilings.samples": 2}):
        rates = roofline.measure_ceilings(["matmul:gemm_tf32"], dev)
        tf32_calls = calls[:]
        calls.clear()
        rates |= roofline.measure_ceilings(["matmul:gemm_float32"], dev)
    # The window, then its timed calls: no median of samples, on tensor cores or not.
    assert tf32_calls == ["busy 0.2"]
    assert calls == ["busy 0.2"]
    assert rates["gemm_tf32"] > rates["gemm_float32"] > 1  # TFLOP/s: any GPU of this decade


def _uses_cuda(pid: int) -> bool:
    """Whether process ``pid`` has CUDA's unified-memory device open (a context opens it; NVML does not)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return any("nvidia-uvm" in link for link in links)


def test_gpu_workers_forked_from_the_server_make_their_own_context(tmp_path):
    from mgpu import forkserver

    forkserver.start()
    try:
        server = forkserver._server()._forkserver_pid
        job = write_job(
            tmp_path / "matmul.yaml",
            {
                "workload": "matmul",
                "params": {"m": 4096, "n": 4096, "k": 4096},
                "cluster": {"backend": "cuda", "devices": 1, "workers_per_device": 2, "dashboard": None},
            },
        )
        watch = _Watch()
        result = mgpu.run(job, events=watch)
        assert result.status == "ok"
        assert [w["ppid"] for w in watch.workers] == [server, server]
        # The server imported CuPy, RMM and dask-cuda without a CUDA context of its own.
        assert not _uses_cuda(server)
    finally:
        forkserver.stop()
