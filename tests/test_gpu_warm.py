"""On GPUs: the jobs of one submit warm each worker up once for their key, and a job sent
no warm-up still gets its own window of allocator statistics (opened by the round trip
that found its workers), covering its tiles; a job of another tile shape is warmed up.

Run on a GPU machine with ``pytest -m gpu``; skipped where CuPy or a GPU is missing.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")

from mgpu.client.run import run_jobs  # noqa: E402
from mgpu.spec import validate_job  # noqa: E402


def _matmul(m: int, seed: int) -> dict:
    return {
        "name": f"matmul-{m}-{seed}",
        "workload": "matmul",
        "params": {"m": m, "n": 4096, "k": 4096, "dtype": "float32", "seed": seed},
        "cluster": {"backend": "cuda", "devices": [0], "dashboard": None, "allocator": "pool", "memory_limit": "4GB"},
    }


def test_a_warm_gpu_worker_gets_no_warm_up_and_each_job_its_allocator_window():
    jobs = [_matmul(4096, 1), _matmul(4096, 2), _matmul(2048, 3)]
    results = run_jobs([validate_job(j) for j in jobs])
    assert [r.status for r in results] == ["ok"] * 3 and all(r.verify.passed for r in results)
    # The second job's product is the first's: warm. The third's tiles are another shape.
    assert [r.startup.warmups for r in results] == [1, 0, 1]
    # The second job's window is its own (opened as its worker was found): its tile's
    # allocations alone, where the first's held its warm-up's too.
    first, second = (r.per_worker[0].allocator for r in results[:2])
    assert first is not None and second is not None and 0 < second.total_count < first.total_count
    for r in results:
        (row,) = r.per_worker
        a = row.allocator
        t = r.plan["tile_shape"]
        held = 4 * (t["m"] * t["k"] + t["k"] * t["n"] + t["m"] * t["n"])
        # Each job's window holds its own tiles' allocations, opened for it (the second by
        # the round trip that found the worker, with no warm-up), and no other job's.
        assert a is not None and a.kind == "pool"
        assert held <= a.peak_bytes <= r.plan["budget"] and a.total_count > 0
        st = r.startup
        parts = [st.cluster_s, st.ceilings_s, st.plan_s, st.warmup_s, st.first_tile_s, st.later_tiles_s, st.finish_s]
        assert sum(parts) == pytest.approx(r.wall_s, rel=1e-9)
