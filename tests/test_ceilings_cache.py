"""The ceilings cache has one key, made in one place: by model, memory, GPU driver and
software, the same for the workers' runs and the client's estimate."""

from __future__ import annotations

import dask.config

from mgpu import roofline
from mgpu.client import estimate
from mgpu.worker.device import DeviceFacts


def _gpus(n: int) -> dict[str, DeviceFacts]:
    return {f"w{i}": DeviceFacts("cuda", i, "NVIDIA H100", 80 << 30, 80 << 30, "h") for i in range(n)}


def _cpus(n: int) -> dict[str, DeviceFacts]:
    return {f"c{i}": DeviceFacts("cpu", i, "cpu", 4 << 30, 4 << 30, "h") for i in range(n)}


def test_a_gpu_key_holds_the_driver_and_a_cpu_key_does_not():
    versions = {"numpy": "2.0", "mgpu": "0.1.0"}
    old, new = ({**versions, "driver": d} for d in ("575.51", "580.65"))
    gpu = _gpus(1)
    assert roofline.cache_keys(gpu, {"w0": old}) != roofline.cache_keys(gpu, {"w0": new})
    assert "driver=580.65" in roofline.cache_keys(gpu, {"w0": new})["w0"]
    cpu = _cpus(1)
    assert roofline.cache_keys(cpu, {"c0": old}) == roofline.cache_keys(cpu, {"c0": new})


def test_cpu_workers_of_one_host_share_the_key_of_rates_measured_at_once():
    cpus = _cpus(3)
    alone = roofline.cache_keys(cpus, {})
    shared = roofline.cache_keys(cpus, {}, at_once=True)
    assert len(set(shared.values())) == 1 and shared["c0"] == roofline.shared_key(alone["c0"], 3)


def test_the_estimate_reads_the_entries_the_workers_write(tmp_path):
    """What a run caches under the workers' keys is what the client's estimate finds."""
    devices = _cpus(2)
    here = roofline.software(driver=False)
    keys = roofline.cache_keys(devices, dict.fromkeys(devices, here), at_once=True)
    rates = {name: 1.0 for name in roofline.ceiling_units()}
    with dask.config.set({"mgpu.cache-dir": str(tmp_path)}):
        roofline.write_cache({key: rates for key in keys.values()})
        found, source = estimate.local_ceilings(devices)
    assert source == "cached" and found == {addr: rates for addr in devices}


def test_a_job_measures_only_the_groups_it_reads():
    """Mandelbrot's bound and estimate read its kernel's rate alone: its first job on a
    machine measures no copy or transfer; a matmul's reads the device's own too."""
    assert roofline.all_groups(["mandelbrot"]) == ["mandelbrot"]
    assert roofline.all_groups(["matmul"]) == ["device", "matmul"]
    assert roofline.all_groups()[0] == "device"  # every ceiling (mgpu info --calibrate)


def test_a_job_measures_its_own_bound_alone_among_its_workloads_ceilings():
    import numpy as np

    from mgpu.spec import validate_job
    from mgpu.worker.device import Device
    from mgpu.workloads import get_workload_class

    def workload(doc: dict) -> object:
        job = validate_job(doc)
        return get_workload_class(job.workload)(job.params)

    f32 = workload({"workload": "matmul", "params": {"m": 8, "n": 8, "k": 8}})
    tf32 = workload({"workload": "matmul", "params": {"m": 8, "n": 8, "k": 8, "precision": "tf32"}})
    assert roofline.job_groups(f32) == ["matmul:gemm_float32"]
    assert roofline.job_groups(workload({"workload": "dot", "params": {"n": 8}})) == ["dot"]  # bound by the copy
    cpu = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    assert set(roofline.measure_ceilings(roofline.job_groups(f32), cpu)) == {"gemm_float32"}
    # A TF32 job after a float32 one finds its own bound missing, and measures it.
    assert roofline.groups_missing({"gemm_float32": 1.0}, roofline.job_groups(tf32)) == ["matmul:gemm_tf32"]
    assert roofline.groups_missing({"gemm_float32": 1.0}, roofline.job_groups(f32)) == []
