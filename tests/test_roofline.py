"""Ceilings: measured once per device model, cached, and set against every result."""

from __future__ import annotations

import json

import dask.config
import pytest
from conftest import submit_json, write_job

JOB = {"workload": "matmul", "params": {"m": 64, "n": 48, "k": 32}}


@pytest.fixture
def cache_dir(tmp_path):
    folder = tmp_path / "cache"
    with dask.config.set({"mgpu.cache-dir": str(folder)}):
        yield folder


def test_roofline_is_the_sum_of_cached_ceilings(tmp_path, scheduler, cache_dir):
    job = write_job(tmp_path / "job.yaml", JOB)
    # First run measures and caches each device model's ceilings.
    res, first = submit_json(job, tmp_path / "a.json", "--scheduler", scheduler)
    assert res.code == 0, res.output
    cache_file = cache_dir / "ceilings.json"
    cache = json.loads(cache_file.read_text())
    # Two CPU workers of one model: one entry of each measured alone, one of both at once (the estimate's).
    ((key, rates),) = [(k, r) for k, r in cache.items() if not k.endswith(" at once")]
    assert set(cache) == {key, f"{key}|2 at once"}
    assert {"gemm_float32", "copy"} <= set(rates)
    # The job's own bound alone: float64's, Mandelbrot's, measured once a job reads them.
    assert "gemm_float64" not in rates and "mandelbrot_float32" not in rates
    assert all(v > 0 for v in rates.values())

    # Replace the cached figure: a second run must use it, not measure again.
    rates["gemm_float32"] = 123.0
    cache_file.write_text(json.dumps({key: rates}))
    res, second = submit_json(job, tmp_path / "b.json", "--scheduler", scheduler)
    assert res.code == 0, res.output
    roof = second["roofline"]
    assert roof["limit"] == pytest.approx(2 * 123.0)
    assert roof["fraction"] == pytest.approx(second["throughput"]["value"] / (2 * 123.0))
    assert "gemm_float32" in roof["basis"]
    assert json.loads(cache_file.read_text())[key]["gemm_float32"] == 123.0


def test_each_workload_is_set_against_its_own_ceiling(tmp_path, scheduler, cache_dir):
    jobs = {
        "dot": ({"workload": "dot", "params": {"n": 1000}}, "copy"),
        "mandelbrot": (
            {"workload": "mandelbrot", "params": {"width": 40, "height": 30, "dtype": "float64"}},
            "mandelbrot_float64",
        ),
        "matmul-f64": ({"workload": "matmul", "params": {"m": 8, "n": 8, "k": 8, "dtype": "float64"}}, "gemm_float64"),
    }
    for name, (doc, ceiling) in jobs.items():
        res, data = submit_json(
            write_job(tmp_path / f"{name}.yaml", doc), tmp_path / f"{name}.json", "--scheduler", scheduler
        )
        assert res.code == 0, res.output
        cache = json.loads((cache_dir / "ceilings.json").read_text())
        (rates,) = [r for k, r in cache.items() if not k.endswith(" at once")]
        assert data["roofline"]["limit"] == pytest.approx(2 * rates[ceiling]), name


def test_every_workload_measures_its_own_ceilings_each_with_a_unit(scheduler, cache_dir):
    """roofline names no workload: it asks each registered one for its ceilings and units."""
    from mgpu.cluster import open_cluster, resolve_cluster
    from mgpu.roofline import DEVICE_CEILINGS, ceiling_units, ceilings_for
    from mgpu.spec import ClusterSpec
    from mgpu.workloads import get_workload_class, workload_names

    with open_cluster(resolve_cluster(ClusterSpec(scheduler=scheduler, dashboard=None))) as info:
        rates = ceilings_for(info.client, info.devices)
    units = ceiling_units()
    assert set(DEVICE_CEILINGS) <= set(units)
    for per_worker in rates.values():
        assert set(per_worker) <= set(units) and all(v > 0 for v in per_worker.values())
        assert "copy" in per_worker
        for name in workload_names():
            declared = set(get_workload_class(name).ceiling_units)
            assert not declared or declared & set(per_worker), name
    # What each job is set against is a ceiling that was measured.
    assert {"gemm_float32", "gemm_float64", "mandelbrot_float32", "mandelbrot_float64"} <= set(per_worker)


def test_a_jobs_ceiling_units_are_the_devices_and_its_workloads_alone():
    # A job's plan splits its own ceilings among workers sharing a GPU: it needs no other
    # workload's units (reading them all imported every registered workload, in every job).
    from mgpu.roofline import DEVICE_CEILINGS, ceiling_units
    from mgpu.workloads import get_workload_class, workload_names

    for name in workload_names():
        cls = get_workload_class(name)
        assert ceiling_units(cls) == {**DEVICE_CEILINGS, **cls.ceiling_units}
    assert ceiling_units() == {
        k: v
        for name in workload_names()
        for k, v in {**DEVICE_CEILINGS, **get_workload_class(name).ceiling_units}.items()
    }
