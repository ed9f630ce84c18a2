"""Several workers on one device: each physical device is counted once (devices, per_device,
the roofline), each worker's budget is its share of what it really has, and a job that cannot
fit a joined cluster's workers exits 2 naming the budget. CPU workers run the same code: a
test gives several of them one device identity, as workers sharing a GPU report theirs."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from typing import Any

import pytest
from conftest import invoke, start_local_cluster, write_job
from distributed import Client

import mgpu
from mgpu import cluster as cluster_mod
from mgpu.cluster import budget_basis, budget_for, expected_devices, resolve_cluster, worker_budget
from mgpu.cuda_cluster import start_cuda_cluster, worker_names
from mgpu.gpus import Gpu, format_uuid
from mgpu.sharing import by_device, first_per_device, share_rates, shared_by
from mgpu.spec import ClusterSpec
from mgpu.worker.device import DeviceFacts
from mgpu.worker.plugins import RuntimeSetup
from mgpu.worker.tasks import current as current_runtime

GiB = 1 << 30


def _gpu(uuid: str, ordinal: int = 0, *, budget: int | None = None, free: int = 70 * GiB, pid: int = 0) -> DeviceFacts:
    return DeviceFacts("cuda", ordinal, "H100", 80 * GiB, free, "node", "9.0", uuid=uuid, budget=budget, pid=pid)


FOUR_ON_TWO = {
    "w0": _gpu("GPU-a", 0),
    "w1": _gpu("GPU-a", 0),
    "w2": _gpu("GPU-a", 0),
    "w3": _gpu("GPU-b", 1),
}


def test_workers_that_name_one_device_count_it_once():
    assert by_device(FOUR_ON_TWO) == {"GPU-a": ["w0", "w1", "w2"], "GPU-b": ["w3"]}
    assert shared_by(FOUR_ON_TWO) == {"w0": 3, "w1": 3, "w2": 3, "w3": 1}
    ceilings = {addr: {"gemm_float32": 50.0, "h2d_pinned": 25.0} for addr in FOUR_ON_TWO}
    assert list(first_per_device(ceilings, FOUR_ON_TWO)) == ["w0", "w3"]
    # A worker's share of a rate is the device's over its sharers; the estimate counts on that.
    shares = share_rates(ceilings, FOUR_ON_TWO, {"gemm_float32": "TFLOP/s", "h2d_pinned": "GB/s"})
    assert shares["w1"] == {"gemm_float32": pytest.approx(50 / 3), "h2d_pinned": pytest.approx(25 / 3)}
    assert shares["w3"] == ceilings["w3"]


def test_facts_without_a_uuid_are_each_their_own_device():
    a = DeviceFacts("cpu", 0, "cpu", GiB, GiB, "h")
    b = DeviceFacts("cpu", 1, "cpu", GiB, GiB, "h")
    assert a.physical != b.physical and shared_by({"a": a, "b": b}) == {"a": 1, "b": 1}


def test_a_gpus_budget_is_split_among_its_workers_and_capped_by_their_pools():
    alone = _gpu("GPU-a")
    assert worker_budget("auto", alone, 1) == int(0.8 * 80 * GiB)
    assert worker_budget("auto", alone, 4) == int(0.8 * 80 * GiB) // 4
    # Less free than the share (the others hold theirs already): what is free.
    assert worker_budget("auto", _gpu("GPU-a", free=5 * GiB), 4) == 5 * GiB
    # A worker with a pool of known size has that, whatever else shares the device.
    assert worker_budget("auto", _gpu("GPU-a", budget=12 * GiB), 4) == 12 * GiB
    # An explicit limit is the device's: split, and never past the worker's pool.
    assert worker_budget(40 * GiB, alone, 4) == 10 * GiB
    assert worker_budget(40 * GiB, _gpu("GPU-a", budget=8 * GiB), 4) == 8 * GiB
    assert worker_budget(0.5, alone, 2) == 20 * GiB
    # A CPU worker's memory is its own limit already: not split.
    cpu = DeviceFacts("cpu", 0, "cpu", 4 * GiB, 4 * GiB, "h", uuid="h/cpu-0")
    assert worker_budget("auto", cpu, 3) == 2 * GiB
    # The plan's budget is the smallest worker's, and the message names it and its pool.
    mixed = {**FOUR_ON_TWO, "w3": _gpu("GPU-b", 1, budget=12 * GiB)}
    assert budget_for("auto", mixed) == 12 * GiB
    assert budget_basis("auto", mixed) == "the budget, 12.00 GiB a worker, is worker w3's: the size of its RMM pool"
    assert budget_for("auto", FOUR_ON_TWO) == int(0.8 * 80 * GiB) // 3
    assert "w0's: 0.8 of its GPU's 80.00 GiB, shared by 3 workers" in budget_basis("auto", FOUR_ON_TWO)


def test_the_devices_mgpu_would_start_hold_n_workers_per_gpu_each_with_its_share(monkeypatch):
    gpus = [Gpu(i, f"GPU-{i}", "H100", 80 * GiB, 79 * GiB, "9.0") for i in range(2)]
    monkeypatch.setattr(cluster_mod, "nvml_gpus", lambda ordinals: [gpus[i] for i in ordinals])
    monkeypatch.setattr(cluster_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(cluster_mod, "visible_count", lambda: 2)
    rc = resolve_cluster(ClusterSpec(backend="cuda", devices=[0, 1], workers_per_device=4))
    assert rc.workers_per_device == 4
    expected = expected_devices(rc)
    assert expected is not None and len(expected) == 8
    assert {addr: f.uuid for addr, f in expected.items() if addr.startswith("cuda-1")} == {
        f"cuda-1-{k}": "GPU-1" for k in range(4)
    }
    assert budget_for(rc.memory_limit, expected) == int(0.8 * 80 * GiB) // 4
    # CPU workers are one per core already: the key leaves them as they are.
    assert resolve_cluster(ClusterSpec(backend="cpu", devices=2, workers_per_device=4)).workers_per_device == 1


def test_a_cuda_uuid_reads_as_nvml_writes_it():
    raw = bytes(range(16))
    assert format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


class _FakeLocalCUDACluster:
    """dask-cuda's LocalCUDACluster as far as naming workers goes: one spec per device, made
    for the first device that has no worker (its new_worker_spec), scaled to n_workers."""

    def __init__(self, CUDA_VISIBLE_DEVICES: str, n_workers: int | None = None, **kwargs: Any) -> None:
        self.cuda_visible_devices = [int(d) for d in CUDA_VISIBLE_DEVICES.split(",")]
        self.kwargs = kwargs
        self.worker_spec: dict[Any, Any] = {}
        while len(self.worker_spec) < (n_workers or len(self.cuda_visible_devices)):
            self.worker_spec.update(self.new_worker_spec())

    def new_worker_spec(self) -> dict[Any, Any]:
        try:
            name = min(set(self.cuda_visible_devices) - set(self.worker_spec))
        except ValueError:
            raise ValueError("Can not scale beyond visible devices", self.cuda_visible_devices) from None
        rotated = self.cuda_visible_devices[self.cuda_visible_devices.index(name) :]
        return {name: {"options": {"env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, rotated))}}}}


def test_n_workers_per_gpu_each_get_the_spec_dask_cuda_makes_for_that_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=_FakeLocalCUDACluster))
    cluster = start_cuda_cluster([0, 1], 3, rmm_pool_size=0.8 / 3)
    visible = {name: spec["options"]["env"]["CUDA_VISIBLE_DEVICES"] for name, spec in cluster.worker_spec.items()}
    assert visible == {f"0-{k}": "0,1" for k in range(3)} | {f"1-{k}": "1" for k in range(3)}
    assert cluster.kwargs == {"rmm_pool_size": 0.8 / 3}
    with pytest.raises(ValueError, match="more than 3 workers on each"):
        cluster.new_worker_spec()
    assert worker_names([0], 2) == [("0-0", 0), ("0-1", 0)]
    # One per GPU is dask-cuda's own cluster, its workers named by device.
    assert set(start_cuda_cluster([0, 1], 1).worker_spec) == {0, 1}


def _takes_turns(dask_worker: Any = None) -> bool:
    return current_runtime(dask_worker).turns.shared


def _share_one_device(dask_worker: Any = None) -> str:
    rt = current_runtime(dask_worker)
    rt.device.facts = dataclasses.replace(rt.device.facts, uuid="GPU-shared")
    return rt.device.facts.physical


def test_workers_sharing_a_device_are_one_device_in_the_result_and_its_roofline():
    with start_local_cluster() as cluster, Client(cluster) as client:
        job = {
            "workload": "matmul",
            "params": {"m": 256, "n": 192, "k": 96, "dtype": "float64"},
            "tiling": {"m": 64},
            "cluster": {"dashboard": None},
        }
        apart = mgpu.run(job, client)
        assert set(client.run(_takes_turns).values()) == {False}
        client.register_plugin(RuntimeSetup("auto"))  # the runtime mgpu.run keeps (idempotent)
        assert set(client.run(_share_one_device).values()) == {"GPU-shared"}
        shared = mgpu.run(job, client)
        # Workers sharing a device take turns at it (mgpu.worker.turns), told so as they are found.
        assert set(client.run(_takes_turns).values()) == {True}
    assert apart.verify.passed and shared.verify.passed
    assert [d["workers"] for d in apart.devices] == [1, 1] and len(apart.per_device) == 2
    # One device, both workers on it: one row of every tile, and a row per worker beside it.
    assert shared.devices == [{**shared.devices[0], "uuid": "GPU-shared", "workers": 2}]
    (row,) = shared.per_device
    assert sorted(row.workers) == sorted(w.worker for w in shared.per_worker) and len(row.workers) == 2
    assert row.tiles == shared.plan["tiles"] == sum(w.tiles for w in shared.per_worker) == 4
    assert all(w.tiles >= 1 and w.uuid == "GPU-shared" for w in shared.per_worker)
    # The roofline counts the device once: half the limit of two devices of their own.
    assert apart.roofline is not None and shared.roofline is not None
    assert shared.roofline.limit == pytest.approx(apart.roofline.limit / 2, rel=1e-9)
    assert "1 x gemm_float64" in shared.roofline.basis and "2 workers shared the 1 device" in shared.roofline.basis


def test_a_joined_cluster_plans_for_its_workers_memory_limit_and_refuses_what_cannot_fit(tmp_path):
    with start_local_cluster(memory_limit="256MiB") as cluster:
        fits = write_job(tmp_path / "fits.yaml", {"workload": "matmul", "params": {"m": 64, "n": 64, "k": 64}})
        res = invoke("submit", fits, "--scheduler", cluster.scheduler_address, "--json", tmp_path / "r.json", "-q")
        assert res.code == 0, res.output
        assert json.loads((tmp_path / "r.json").read_text())["plan"]["budget"] == 128 << 20  # 0.5 of 256 MiB
        wide = write_job(
            tmp_path / "wide.yaml",
            {"workload": "mandelbrot", "params": {"width": 60_000_000, "height": 2, "max_iter": 2}},
        )
        res = invoke("submit", wide, "--scheduler", cluster.scheduler_address, "--json", tmp_path / "w.json", "-q")
    assert res.code == 2, res.output
    assert "Traceback" not in res.output and not (tmp_path / "w.json").exists()
    assert "the budget, 128.00 MiB a worker" in res.stderr and "0.5 of its memory limit, 256.00 MiB" in res.stderr


@pytest.mark.parametrize("value", ["0", "33", "two"])
def test_workers_per_device_outside_1_to_32_is_refused_naming_the_key(tmp_path, value):
    job = write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 100}})
    res = invoke("submit", job, "--workers-per-device", value, "--backend", "cpu")
    assert res.code == 2 and "cluster.workers_per_device" in res.stderr and "Traceback" not in res.output


def test_a_report_counts_a_shared_gpu_once_and_scales_only_across_devices():
    from mgpu.report import ROW_FIELDS, summarize, table_rows

    run = {k: None for k in ROW_FIELDS} | {
        "job": "j",
        "workload": "mandelbrot",
        "mode": "strong",
        "size": "s",
        "base_size": "s",
        "status": "ok",
        "unit": "Giter/s",
        "seconds": 1.0,
        "throughput": 100.0,
        "roofline_fraction": 0.9,
    }
    rows = [
        run | {"devices": 1, "workers": 1},
        run | {"devices": 1, "workers": 4, "throughput": 98.0},
        run | {"devices": 2, "workers": 2, "throughput": 190.0},
    ]
    summary = {(e["devices"], e["workers"]): e for e in summarize(rows)}
    assert set(summary) == {(1, 1), (1, 4), (2, 2)}
    assert summary[2, 2]["efficiency"] == pytest.approx(0.95)
    # Four workers on one GPU are one device: no series of device counts, no efficiency.
    assert summary[1, 4]["efficiency"] is None and summary[1, 4]["baseline_devices"] is None
    _, cells = table_rows(list(summary.values()))
    assert ["1 (4 workers)", "s"] in [c[:2] for c in cells]


def test_a_gpu_workers_budget_is_the_pool_dask_cuda_gave_it():
    from mgpu.worker.runtime import _rmm_budget

    rmm_setup = type("RMMSetup", (), {})()  # dask_cuda.plugins.RMMSetup, once set up: sizes in bytes
    rmm_setup.initial_pool_size, rmm_setup.maximum_pool_size = 12 * GiB, None
    worker = types.SimpleNamespace(plugins={"RMMSetup-3f2a": rmm_setup, "other": object()})
    assert _rmm_budget(worker) == 12 * GiB
    rmm_setup.maximum_pool_size = 16 * GiB  # a pool that may grow to a cap: the cap
    assert _rmm_budget(worker) == 16 * GiB
