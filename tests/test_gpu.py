"""GPU tests: the CuPy kernels equal the NumPy definitions, and jobs run on LocalCUDACluster.

Run on a GPU machine with ``pytest -m gpu``; skipped where CuPy or a GPU is missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")

from conftest import cuda_cluster, gpu_count, gpu_workers, npy_operands, sharing_one_gpu, wait_for  # noqa: E402

from mgpu.client.run import run_job  # noqa: E402
from mgpu.spec import validate_job  # noqa: E402
from mgpu.worker import kernels  # noqa: E402
from mgpu.workloads.dot import kernels as dot_kernels  # noqa: E402


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize(
    "rows,cols,total",
    [
        ((0, 1), (0, 1), 1),
        ((3, 17), (5, 1000), 1013),  # a block inside the operand: the 32-bit division path
        ((100, 613), (0, 997), 997),  # full width: no division
        ((4, 5), (7, 70_000), 80_000),  # one row of the operand
    ],
)
def test_random_block_is_bit_identical_on_gpu(dtype, rows, cols, total):
    kw = dict(seed=7, operand=1, rows=rows, cols=cols, total_cols=total, dtype=dtype)
    cpu = kernels.random_block(np, **kw)
    gpu = cupy.asnumpy(kernels.random_block(cupy, **kw))
    assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    np.testing.assert_array_equal(_bits(gpu), _bits(cpu))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize(
    "rows,cols,total",
    [
        ((3, 17), (5, 1000), 1013),  # rows of 995: no vector stores
        ((2, 40), (8, 1008), 1100),  # rows of 1000: vector stores
        ((0, 1), (3, 5001), 5001),  # one row, unaligned length: a vector tail
        ((7, 9), (0, 5000), 5000),  # full width
    ],
)
def test_random_block_launched_in_pieces_is_bit_identical(monkeypatch, dtype, rows, cols, total):
    # Pieces of 2^30 elements keep the kernel's index math 32-bit; 512-element pieces here
    # run the same splitting at a size NumPy can check.
    monkeypatch.setattr(kernels, "RANDOM_LAUNCH", 512)
    kw = dict(seed=11, operand=0, rows=rows, cols=cols, total_cols=total, dtype=dtype)
    np.testing.assert_array_equal(
        _bits(cupy.asnumpy(kernels.random_block(cupy, **kw))), _bits(kernels.random_block(np, **kw))
    )


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("elements,launch", [((0, 100_003), 1 << 30), ((777, 50_000), 4096)])
def test_random_pair_makes_the_vectors_and_sums_their_products(monkeypatch, dtype, elements, launch):
    monkeypatch.setattr(kernels, "RANDOM_LAUNCH", launch)
    kw = dict(seed=4, operands=(0, 1), elements=elements, dtype=dtype)
    x, y, sums = dot_kernels.random_pair_with_sums(cupy, **kw)
    cx, cy, csums = dot_kernels.random_pair_with_sums(np, **kw)
    np.testing.assert_array_equal(_bits(cupy.asnumpy(x)), _bits(cx))
    np.testing.assert_array_equal(_bits(cupy.asnumpy(y)), _bits(cy))
    # The same products, grouped otherwise: float64 rounding apart only.
    np.testing.assert_allclose(cupy.asnumpy(sums), csums, rtol=1e-12)
    assert csums[1] > abs(csums[0]) > 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mandelbrot_counts_match_numpy_exactly(dtype):
    # A window on the boundary, where any rounding difference would change counts.
    from mgpu.workloads.mandelbrot import mandelbrot_axes, mandelbrot_counts

    x, y = mandelbrot_axes(width=301, height=97, bounds=(-0.75, -0.73, 0.1, 0.12), rows=(0, 97), dtype=dtype)
    cpu = mandelbrot_counts(np, x, y, 2000)
    gpu = cupy.asnumpy(mandelbrot_counts(cupy, cupy.asarray(x), cupy.asarray(y), 2000))
    assert len(np.unique(cpu)) > 50  # the window really is on the boundary
    np.testing.assert_array_equal(gpu, cpu)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n,offset", [(1, 0), (7, 1), (1_000_003, 0), (1_000_003, 3), (1 << 24, 0)])
def test_dot_kernel_accumulates_in_float64(dtype, n, offset):
    rng = np.random.default_rng(n + offset)
    x = rng.standard_normal(n + offset).astype(dtype)
    y = rng.standard_normal(n + offset).astype(dtype)
    want = float(np.dot(x[offset:].astype(np.float64), y[offset:].astype(np.float64)))
    got = dot_kernels.dot_f64(cupy, cupy.asarray(x)[offset:], cupy.asarray(y)[offset:])
    scale = float(np.abs(x[offset:].astype(np.float64) * y[offset:]).sum())
    assert abs(got - want) <= 1e-13 * scale


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize(
    "rows,cols,total",
    [
        ((0, 1), (0, 1), 1),
        ((3, 17), (5, 1000), 1013),  # a block inside the operand, rows a multiple of every vector
        ((2, 40), (8, 1011), 1100),  # rows with a tail past the vectors
        ((100, 3100), (0, 4104), 4104),  # full width, more rows than blocks
    ],
)
def test_random_block_matvec_is_the_block_and_its_matvec_bit_for_bit(dtype, rows, cols, total):
    kw = dict(seed=9, operand=1, rows=rows, cols=cols, total_cols=total, dtype=dtype)
    v = cupy.asarray(np.random.default_rng(1).standard_normal(cols[1] - cols[0]))
    block, sums = kernels.random_block_matvec(cupy, **kw, v=v)
    np.testing.assert_array_equal(_bits(cupy.asnumpy(block)), _bits(kernels.random_block(np, **kw)))
    want = kernels.matvec_f64(cupy, kernels.random_block(cupy, **kw), v)  # the two calls it replaces
    assert sums.dtype == np.float64
    np.testing.assert_array_equal(cupy.asnumpy(sums), cupy.asnumpy(want))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 4099), (3001, 517), (7, 4104), (64, 1 << 17)])
def test_matvec_f64_kernel_matches_numpy(dtype, rows, cols):
    rng = np.random.default_rng(rows * cols)
    m = rng.standard_normal((rows, cols)).astype(dtype)
    v = rng.standard_normal(cols)
    want = m.astype(np.float64) @ v
    got = cupy.asnumpy(kernels.matvec_f64(cupy, cupy.asarray(m), cupy.asarray(v)))
    scale = np.abs(m.astype(np.float64)) @ np.abs(v)
    assert (np.abs(got - want) <= 1e-13 * scale + 1e-300).all()
    # Rows that start off a 16-byte boundary are read an element at a time.
    flat = cupy.asarray(np.concatenate([m.reshape(-1)[:1], m.reshape(-1)]))[1:]
    got = cupy.asnumpy(kernels.matvec_f64(cupy, flat.reshape(rows, cols), cupy.asarray(v)))
    assert (np.abs(got - want) <= 1e-13 * scale + 1e-300).all()
    # A strided view is read correctly too (made contiguous first).
    view = cupy.asarray(m)[:, ::2]
    got = cupy.asnumpy(kernels.matvec_f64(cupy, view, cupy.asarray(v[::2])))
    np.testing.assert_allclose(got, m[:, ::2].astype(np.float64) @ v[::2], rtol=1e-12, atol=1e-12 * scale.max())


@pytest.mark.parametrize("n", [1, 1000, 10_000_019])
def test_dot_check_sums_products_and_their_magnitudes(n):
    rng = np.random.default_rng(n)
    x, y = rng.standard_normal(n).astype("float32"), rng.standard_normal(n).astype("float32")
    p = x.astype(np.float64) * y.astype(np.float64)
    s, a = dot_kernels.dot_check(cupy, cupy.asarray(x), cupy.asarray(y))
    assert abs(s - p.sum()) <= 1e-13 * np.abs(p).sum()
    assert a == pytest.approx(np.abs(p).sum(), rel=1e-13)


def _job(workload: str, params: dict, **cluster) -> dict:
    return {
        "name": f"gpu-{workload}",
        "workload": workload,
        "params": params,
        "cluster": {"backend": "cuda", "dashboard": None, **cluster},
    }


@pytest.mark.parametrize("precision,dtype", [("default", "float64"), ("tf32", "float32")])
def test_a_tile_of_random_operands_made_beside_its_products_is_the_whole_product(tmp_path, precision, dtype):
    from mgpu.workloads.matmul import overlap

    m, n, k = 4 * overlap.MIN_PIECE_ROWS + 3, 300, 257  # one tile on one GPU: four row pieces
    out = tmp_path / "c.npy"
    params = {"m": m, "n": n, "k": k, "dtype": dtype, "precision": precision, "output": str(out), "seed": 5}
    result = run_job(validate_job(_job("matmul", params, devices=[0])))
    assert result.status == "ok" and result.verify.passed and result.plan["tiles"] == 1
    assert len(overlap.pieces_of(m)) == 4
    a = kernels.random_block(np, seed=5, operand=0, rows=(0, m), cols=(0, k), total_cols=k, dtype=dtype)
    b = kernels.random_block(np, seed=5, operand=1, rows=(0, k), cols=(0, n), total_cols=n, dtype=dtype)
    a, b = a.astype(np.float64), b.astype(np.float64)
    rtol = 1e-12 if dtype == "float64" else 3e-3  # TF32 rounds the operands to 10 bits
    np.testing.assert_allclose(np.load(out), a @ b, rtol=rtol, atol=rtol * np.sqrt(k))


@pytest.mark.parametrize("wrong_piece", [None, 0, 2, 3])
def test_the_check_of_a_tile_made_in_pieces_reads_each_piece_as_its_product_left_it(monkeypatch, wrong_piece):
    # Each piece's C·r is made on the second stream once its product is done: a wrong
    # element written after a product (on the tile's stream) must reach the check, and a
    # C·r made before its product had finished would fail the right answer.
    from mgpu.tiling import Tile
    from mgpu.worker.runtime import _cuda_device
    from mgpu.worker.tile import run_tile
    from mgpu.workloads.matmul import overlap
    from mgpu.workloads.matmul.workload import MatmulParams, PerTileMatmul

    m, n, k = 4 * overlap.MIN_PIECE_ROWS + 3, 300, 257
    job = PerTileMatmul(MatmulParams(m=m, n=n, k=k, dtype="float32", precision="tf32", seed=5))
    tile, dev = Tile(0, {"m": (0, m), "n": (0, n)}), _cuda_device()
    assert overlap.applies(job, dev, tile) and len(overlap.pieces_of(m)) == 4
    product, calls = overlap.product, []

    def product_then_wrong(xp, a, b, c):
        product(xp, a, b, c)
        if len(calls) == wrong_piece:
            c[c.shape[0] // 2, 7] += 100.0
        calls.append(c.shape[0])

    monkeypatch.setattr(overlap, "product", product_then_wrong)
    record = run_tile(job, dev, tile)
    assert len(calls) == 4
    assert record.verify_ok is (wrong_piece is None)


def test_a_tile_made_in_pieces_is_left_queued_for_its_check():
    # The host goes on to the check while the products still run: a wait for them would
    # have returned only after the 0.2 s kernel queued ahead of the tile.
    import time

    from mgpu.tiling import Tile
    from mgpu.worker.kernels import matvec_f64
    from mgpu.worker.runtime import _cuda_device
    from mgpu.worker.tile import TileContext, new_record
    from mgpu.workloads.checks import relative_residual
    from mgpu.workloads.matmul import overlap
    from mgpu.workloads.matmul.workload import MatmulParams, PerTileMatmul

    m, n, k = 2 * overlap.MIN_PIECE_ROWS, 300, 257
    job = PerTileMatmul(MatmulParams(m=m, n=n, k=k, dtype="float32", precision="tf32", seed=5))
    tile, dev = Tile(0, {"m": (0, m), "n": (0, n)}), _cuda_device()
    ctx = TileContext(dev, new_record(dev, tile, time.time(), busy_s=0.0, work=0.0), True, {}, "")
    spin = cupy.RawKernel(
        'extern "C" __global__ void spin(long long cycles) '
        "{ long long t0 = clock64(); while (clock64() - t0 < cycles) {} }",
        "spin",
    )
    with dev.on_stream():
        spin((1,), (1,), (np.int64(400_000_000),))  # 0.2 s at 2 GHz
        c, r, abr, cr = overlap.run(job, ctx, tile)
        assert not dev.stream.done
        dev.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(cr), cupy.asnumpy(matvec_f64(cupy, c, r)))
    assert relative_residual(cupy, cr, abr) <= job.tolerance()


@pytest.mark.parametrize("allocator", ["pool", "async"])
def test_matmul_on_cuda_cluster_matches_cpu_backend(tmp_path, allocator):
    params = {"m": 1031, "n": 517, "k": 263, "dtype": "float32", "seed": 3}
    gpu_out, cpu_out = tmp_path / "gpu.npy", tmp_path / "cpu.npy"
    gpu = run_job(
        validate_job(
            _job("matmul", {**params, "output": str(gpu_out)}, allocator=allocator, memory_limit="2GB"),
        )
    )
    cpu = run_job(
        validate_job(
            {
                **_job("matmul", {**params, "output": str(cpu_out)}),
                "cluster": {"backend": "cpu", "devices": 2, "dashboard": None},
            }
        )
    )
    assert gpu.status == "ok" and gpu.backend == "cuda" and gpu.verify.passed
    assert cpu.status == "ok" and cpu.backend == "cpu" and cpu.verify.passed
    assert gpu.env["allocator"] == allocator
    assert sorted(d.id for d in gpu.per_device) == list(range(gpu_count()))
    a = kernels.random_block(np, seed=3, operand=0, rows=(0, 1031), cols=(0, 263), total_cols=263, dtype="float32")
    b = kernels.random_block(np, seed=3, operand=1, rows=(0, 263), cols=(0, 517), total_cols=517, dtype="float32")
    ref = a.astype(np.float64) @ b.astype(np.float64)
    g, c = np.load(gpu_out), np.load(cpu_out)
    assert g.dtype == np.float32
    tol = 1e-5 * np.abs(ref).max()
    assert np.abs(g - ref).max() <= tol
    assert np.abs(g - c).max() <= tol


def test_tf32_is_really_used(tmp_path):
    params = {"m": 2048, "n": 2048, "k": 2048, "dtype": "float32", "seed": 1}
    exact = run_job(validate_job(_job("matmul", params, devices=1)))
    tf32 = run_job(validate_job(_job("matmul", {**params, "precision": "tf32"}, devices=1)))
    assert exact.verify.passed and tf32.verify.passed
    # TF32 keeps 10 mantissa bits: its residual is orders above full float32's.
    assert tf32.verify.max_rel_error > 50 * exact.verify.max_rel_error


def test_tf32_reaches_the_gemm_that_accumulates_k_blocks():
    from mgpu.worker.runtime import _cuda_device
    from mgpu.workloads.matmul.workload import _gemm_accumulate, _tf32

    dev = _cuda_device()
    a = kernels.random_block(cupy, seed=1, operand=0, rows=(0, 1024), cols=(0, 1024), total_cols=1024, dtype="float32")
    b = kernels.random_block(cupy, seed=1, operand=1, rows=(0, 1024), cols=(0, 1024), total_cols=1024, dtype="float32")
    ref = cupy.asnumpy(a).astype(np.float64) @ cupy.asnumpy(b).astype(np.float64)
    errors = {}
    for tf32 in (False, True):
        c = cupy.zeros((1024, 1024), dtype=cupy.float32)  # given c, the product goes through cublas gemm
        with _tf32(dev, tf32):
            c = _gemm_accumulate(cupy, a, b, c)
        errors[tf32] = np.abs(cupy.asnumpy(c) - ref).max() / np.abs(ref).max()
    assert errors[True] > 50 * errors[False]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dot_on_cuda_cluster(dtype):
    n = 10_000_019
    result = run_job(validate_job(_job("dot", {"n": n, "dtype": dtype, "seed": 5})))
    x = kernels.random_block(np, seed=5, operand=0, rows=(0, 1), cols=(0, n), total_cols=n, dtype=dtype)
    y = kernels.random_block(np, seed=5, operand=1, rows=(0, 1), cols=(0, n), total_cols=n, dtype=dtype)
    want = float(np.dot(x.ravel().astype(np.float64), y.ravel().astype(np.float64)))
    assert result.status == "ok" and result.verify.passed
    assert abs(result.value - want) <= 1e-12 * n
    # Made on the device and reduced: both steps timed apart, each over x and y's bytes.
    nbytes = 2 * n * np.dtype(dtype).itemsize
    assert set(result.phases) == {"generate", "reduce"}
    assert all(p.bytes == nbytes and p.seconds > 0 for p in result.phases.values())


def test_mandelbrot_on_cuda_cluster_equals_cpu_backend(tmp_path):
    params = {"width": 640, "height": 480, "max_iter": 500, "dtype": "float32"}
    gpu = run_job(validate_job(_job("mandelbrot", {**params, "output": {"npy": str(tmp_path / "g.npy")}})))
    cpu = run_job(
        validate_job(
            {
                **_job("mandelbrot", {**params, "output": {"npy": str(tmp_path / "c.npy")}}),
                "cluster": {"backend": "cpu", "devices": 2, "dashboard": None},
            }
        )
    )
    assert gpu.verify.passed and cpu.verify.passed
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), np.load(tmp_path / "c.npy"))
    assert gpu.value is None and gpu.throughput.unit == "Giter/s"


@pytest.mark.multi_gpu(2)
def test_tiles_spread_over_both_workers_and_each_gpu_counts_once():
    result = run_job(validate_job(_job("matmul", {"m": 4096, "n": 4096, "k": 1024}, **gpu_workers(2))))
    assert len(result.per_worker) == 2
    assert all(w.tiles >= 1 and w.busy_s > 0 for w in result.per_worker)
    assert sum(d.tiles for d in result.per_device) == result.plan["tiles"]
    if sharing_one_gpu(2):
        # Two workers, one GPU: one device, one ceiling in the roofline.
        assert [d["workers"] for d in result.devices] == [2] and len(result.per_device[0].workers) == 2
        assert result.roofline is not None and result.roofline.basis.startswith("1 x ")
        assert "2 workers shared the 1 device" in result.roofline.basis
    else:
        assert sorted(d.id for d in result.per_device) == [0, 1]


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("allocator", ["pool", "async"])
def test_distributed_operands_move_between_workers_device_to_device(tmp_path, allocator):
    m, n, k = 3000, 2050, 9000  # k spans several peer blocks
    out = tmp_path / "c.npy"
    params = {"m": m, "n": n, "k": k, "dtype": "float32", "seed": 4, "operands": "distributed", "output": str(out)}
    result = run_job(validate_job(_job("matmul", params, allocator=allocator, **gpu_workers(2))))
    assert result.status == "ok" and result.verify.passed
    assert sorted(w.tiles for w in result.per_worker) == [4, 4]  # B panels in two pieces (there is an output)
    # Each worker read the other's B panel once, by CUDA IPC (over NVLink, or within the one
    # GPU both share), and timed it; none of it went through the host.
    for w in result.per_worker:
        assert w.bytes_d2d == k * (n // 2) * 4
        assert w.d2d_gbps and w.d2d_gbps > 0
        assert w.bytes_h2d == 0
        if sharing_one_gpu(2):
            assert w.bytes_same_device == w.bytes_d2d and w.copies_same_device >= 2
        else:
            assert w.bytes_same_device == 0 and w.copies_same_device == 0
    a = kernels.random_block(np, seed=4, operand=0, rows=(0, m), cols=(0, k), total_cols=k, dtype="float32")
    b = kernels.random_block(np, seed=4, operand=1, rows=(0, k), cols=(0, n), total_cols=n, dtype="float32")
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(np.load(out) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.multi_gpu(2)
def test_a_corrupted_peer_tile_is_caught():
    from distributed import Client
    from faults import SpoilTile

    params = {"m": 2048, "n": 2048, "k": 5000, "operands": "distributed"}
    with cuda_cluster(2) as cluster, Client(cluster) as client:
        client.register_plugin(SpoilTile(1))  # tile 1: GPU 0's peer-fed tile
        doc = {**_job("matmul", params), "cluster": {"scheduler": cluster.scheduler_address, "dashboard": None}}
        result = run_job(validate_job(doc))
    assert result.status == "failed" and result.verify.failed_tiles == [1]


@pytest.mark.multi_gpu(2)
def test_a_joined_cluster_is_planned_for_its_workers_pools_and_refuses_what_cannot_fit():
    from distributed import Client

    from mgpu.errors import JobInputError

    with cuda_cluster(2, rmm_pool_size="1GB") as cluster, Client(cluster):
        joined = {"scheduler": cluster.scheduler_address, "dashboard": None}
        result = run_job(validate_job({**_job("matmul", {"m": 8192, "n": 8192, "k": 8192}), "cluster": joined}))
        # Planned for each worker's 1 GB pool, not for the device (nor a share of it).
        assert result.verify.passed and result.plan["budget"] == 10**9
        wide = {**_job("mandelbrot", {"width": 400_000_000, "height": 2, "max_iter": 2}), "cluster": joined}
        with pytest.raises(
            JobInputError, match=r"the budget, 0\.93 GiB a worker, is worker .*'s: the size of its RMM pool"
        ):
            run_job(validate_job(wide))


@pytest.mark.parametrize("allocator", ["pool", "async"])
def test_spill_to_managed_memory_finishes_a_tile_bigger_than_the_budget(allocator):
    # A 1 GB cap and a tile that needs ~1.8 GB: what spills stays far below the card's free memory.
    params = {"m": 12288, "n": 12288, "k": 12288, "dtype": "float32", "seed": 2}
    doc = _job("matmul", params, devices=[0], allocator=allocator, memory_limit="1GB", spill="managed")
    doc["tiling"] = {"m": 12288, "n": 12288, "k": 12288}
    result = run_job(validate_job(doc))
    assert result.status == "ok" and result.verify.passed
    assert result.spill.events >= 1 and result.spill.bytes >= 12288 * 12288 * 4

    from mgpu.errors import JobInputError

    doc["cluster"]["spill"] = "none"
    with pytest.raises(JobInputError, match="cluster.memory_limit"):
        run_job(validate_job(doc))


def test_within_budget_nothing_spills():
    result = run_job(
        validate_job(
            _job("matmul", {"m": 2048, "n": 2048, "k": 2048}, devices=[0], memory_limit="4GB", spill="managed")
        )
    )
    assert result.verify.passed and result.spill.events == 0 and result.spill.bytes == 0


# -- allocator statistics ----------------------------------------------------------------


def test_cupy_allocations_reach_the_statistics_adaptor():
    # In this process, the way dask-cuda sets a worker up: an RMM pool, CuPy on RMM; then mgpu's plugin.
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator

    from mgpu.worker import device as _device
    from mgpu.worker.plugins import AllocatorStats, RuntimeSetup
    from mgpu.worker.runtime import Runtime

    old_mr, old_alloc = rmm.mr.get_current_device_resource(), cupy.cuda.get_allocator()
    try:
        rmm.mr.set_current_device_resource(
            rmm.mr.PoolMemoryResource(
                rmm.mr.CudaMemoryResource(), initial_pool_size=256 << 20, maximum_pool_size=256 << 20
            )
        )
        cupy.cuda.set_allocator(rmm_cupy_allocator)
        facts = _device.DeviceFacts("cuda", 0, "gpu", 1 << 30, 1 << 30, "host")
        dev = _device.Device("cuda", cupy, facts)
        # A worker as the plugin's setup sees it: one whose runtime holds this device.
        worker = SimpleNamespace(plugins={RuntimeSetup.name: SimpleNamespace(runtime=Runtime(dev))})
        AllocatorStats().setup(worker)
        assert isinstance(rmm.mr.get_current_device_resource(), rmm.mr.StatisticsResourceAdaptor)
        tracker = dev.extra["allocator"]
        tracker.begin()
        x = cupy.zeros(1 << 20, dtype=cupy.uint8)
        y = cupy.ones(2 << 20, dtype=cupy.uint8)
        del x, y
        got = tracker.end()
        assert got["kind"] == "pool" and got["pool_size"] == 256 << 20
        assert got["total_count"] >= 2 and got["peak_bytes"] >= 3 << 20 and got["peak_count"] >= 2
        assert got["current_bytes"] < 1 << 20  # both freed
    finally:
        cupy.cuda.set_allocator(old_alloc)
        rmm.mr.set_current_device_resource(old_mr)


def test_pool_statistics_cover_the_job_within_the_budget():
    params = {"m": 4096, "n": 4096, "k": 4096, "dtype": "float32", "seed": 4}
    result = run_job(validate_job(_job("matmul", params, devices=[0], allocator="pool", memory_limit="2GB")))
    assert result.status == "ok" and result.verify.passed
    (row,) = result.per_device
    a = row.allocator
    budget = result.plan["budget"]
    assert a is not None and a.kind == "pool"
    # dask-cuda made the pool of the budget (aligned to 256 bytes), and it did not grow.
    assert abs(a.pool_size - budget) <= 256
    # A tile holds its A and B blocks and its C tile at once: the peak is at least that.
    t = result.plan["tile_shape"]
    held = 4 * (t["m"] * t["k"] + t["k"] * t["n"] + t["m"] * t["n"])
    assert held <= a.peak_bytes <= budget
    assert row.peak_memory == a.peak_bytes
    assert a.total_count > 0 and a.peak_count >= 3 and a.total_bytes >= held


def test_async_statistics_say_async_and_count_allocations():
    result = run_job(validate_job(_job("matmul", {"m": 2048, "n": 2048, "k": 2048}, devices=[0], allocator="async")))
    (row,) = result.per_device
    assert row.allocator.kind == "async" and row.allocator.pool_size is None
    assert row.allocator.total_count > 0 and row.allocator.peak_bytes >= 3 * 4 * 2048 * 2048


def test_statistics_see_spilled_allocations_too():
    # As in the spill test above: a 1 GB cap, a tile of ~1.8 GB; the adaptor sits above the fallback.
    params = {"m": 12288, "n": 12288, "k": 12288, "dtype": "float32", "seed": 2}
    doc = _job("matmul", params, devices=[0], allocator="pool", memory_limit="1GB", spill="managed")
    doc["tiling"] = {"m": 12288, "n": 12288, "k": 12288}
    result = run_job(validate_job(doc))
    (row,) = result.per_device
    assert result.spill.events >= 1
    assert row.allocator.kind == "pool" and row.allocator.peak_bytes > result.plan["budget"]


def test_default_allocator_reports_cupys_pool_and_no_counts():
    result = run_job(validate_job(_job("matmul", {"m": 1024, "n": 1024, "k": 1024}, devices=[0], allocator="default")))
    (row,) = result.per_device
    assert row.allocator.kind == "default" and row.allocator.pool_size > 0
    assert row.allocator.peak_bytes is None and row.allocator.total_count is None


# -- mgpu bench alloc ----------------------------------------------------------------------


def test_bench_alloc_reports_every_allocator_and_the_fallback_path_falls_back(tmp_path):
    import json

    from mgpu.memory.bench import parse_sizes, run_alloc_bench

    # In-process through the public entry the harness's alloc suite calls.
    bench = run_alloc_bench(device=0, sizes=parse_sizes("1MiB,64MiB"), iterations=5, repeats=2)
    data = json.loads(json.dumps(bench.to_json()))  # as the record holds it
    from mgpu.memory.bench import ALLOCATORS

    assert data["managed_limit"] <= data["device"]["free"] // 16
    rows = {(r["allocator"], r["size"]): r for r in data["rows"]}
    assert set(rows) == {(a, s) for a in ALLOCATORS for s in (1 << 20, 64 << 20)}
    for r in rows.values():
        assert r["skipped"] is None and len(r["samples_us"]) == 2 and r["us"] > 0 and r["vs_cudamalloc"] > 0
    for size in (1 << 20, 64 << 20):
        # The capped pool refused every buffer, and managed memory took each one.
        assert rows[("fallback-spill", size)]["fallback_events"] == (2 + 1) * 5
        assert rows[("fallback", size)]["fallback_events"] == 0
    assert set(data["fallback_overhead_us"]) == {str(1 << 20), str(64 << 20)}


# -- out of core: staged host<->device copies ----------------------------------------


def test_in_order_work_runs_on_one_shared_stream_between_each_threads_own_work():
    import threading

    from mgpu.worker.device import Device, DeviceFacts

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    got: dict = {}

    def band(i: int) -> None:
        with dev.on_stream():
            x = cupy.full(1 << 22, i, cupy.float32)  # on the thread's stream
            with dev.in_order() as queue:
                y = x * 2  # must see x, on the shared stream
            got[i] = (queue, dev.stream, float(y.sum()))  # the thread's stream must see y

    threads = [threading.Thread(target=band, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queues = {id(q) for q, _, _ in got.values()}
    assert len(queues) == 1 and all(q is not own for q, own, _ in got.values())
    assert {i: v for i, (_, _, v) in got.items()} == {i: 2.0 * i * (1 << 22) for i in range(4)}


def check_wait_behind_next_band(dev) -> tuple[float, float]:
    """Two bands' kernels queued in order (each ~40 ms, 40 waves of blocks that fill every
    SM for 1 ms, as a band's many blocks do), then the first band's check, a one-block
    kernel on its thread's stream: (ms from the first kernel's end to the check's end, ms
    of the second kernel). Running blocks are never preempted: a check can only be given
    the SMs of blocks that end, ahead of the second kernel's waiting blocks or after them."""
    import threading

    spin = cupy.RawKernel(
        r"""
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
    }""",
        "spin",
    )
    props = cupy.cuda.runtime.getDeviceProperties(0)
    blocks, cycles = props["multiProcessorCount"] * 8 * 40, cupy.int64(props["clockRate"])  # 1 ms a block
    events = {name: cupy.cuda.Event() for name in ("k1", "k2_start", "k2", "check")}
    first_queued, second_queued = threading.Event(), threading.Event()

    def first_band() -> None:
        with dev.on_stream():
            with dev.in_order() as queue:
                spin((blocks,), (256,), (cycles,))
                events["k1"].record(queue)
            first_queued.set()
            second_queued.wait()
            spin((1,), (32,), (cupy.int64(1000),))  # the check: waits for k1 only
            events["check"].record(dev.stream)
            dev.synchronize()

    band = threading.Thread(target=first_band)
    band.start()
    first_queued.wait()
    with dev.on_stream():
        with dev.in_order() as queue:
            events["k2_start"].record(queue)
            spin((blocks,), (256,), (cycles,))
            events["k2"].record(queue)
    second_queued.set()
    band.join()
    events["k2"].synchronize()
    return (
        cupy.cuda.get_elapsed_time(events["k1"], events["check"]),
        cupy.cuda.get_elapsed_time(events["k2_start"], events["k2"]),
    )


def test_a_bands_check_runs_as_its_kernel_ends_not_after_the_bands_queued_behind_it():
    from mgpu.worker.runtime import _cuda_device

    dev = _cuda_device()
    dev.synchronize()
    wait_ms, second_ms = check_wait_behind_next_band(dev)
    # Without the threads' streams outranking the queue, the check ran after the second
    # band's kernel (its wait as long as that kernel).
    assert second_ms > 20 and wait_ms < 0.25 * second_ms, (wait_ms, second_ms)


def test_staged_copies_round_trip_strided_blocks_through_a_small_ring():
    from mgpu.worker import transfer
    from mgpu.worker.device import Device, DeviceFacts

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    big = np.random.default_rng(1).standard_normal((1500, 700)).astype(np.float32)
    src = big[100:1400, 50:650]  # strided, as a column block of a row-major file
    stager = transfer.Stager(dev, chunk_bytes=64 << 10)  # ~27 rows per chunk: the ring wraps many times
    out = cupy.empty(src.shape, cupy.float32)
    with dev.on_stream():
        stager.load(out, src)
        doubled = out * 2
    back = np.zeros((1500, 700), np.float32)
    stager.store(back[100:1400, 50:650], doubled)
    np.testing.assert_array_equal(back[100:1400, 50:650], 2 * src)
    assert not back[:100].any() and not back[:, :50].any()
    assert dev.bytes_h2d == src.nbytes and dev.bytes_d2h == src.nbytes
    seconds = dev.copy_seconds()
    assert seconds["h2d"] > 0 and seconds["d2h"] > 0


def test_npy_blocks_reach_the_gpu_by_kvikio_and_through_the_map(tmp_path):
    import dask.config

    pytest.importorskip("kvikio")
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.sources import NpySource, inspect_npy

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    data = np.random.default_rng(2).standard_normal((3001, 517)).astype(np.float32)
    np.save(tmp_path / "a.npy", data)
    src = NpySource(inspect_npy(tmp_path / "a.npy", key="a"))
    with dask.config.set({"mgpu.io.task-size": "64KiB", "mgpu.io.threads": 4}):  # many tasks a read
        rows = src.read(dev, (17, 2999))
        block = src.read(dev, (5, 3000), (3, 500))
        with dev.on_stream():
            doubled = rows * 2
        src.read_into(dev, rows, (0, 2982))  # after the product that reads it, not before
    np.testing.assert_array_equal(cupy.asnumpy(doubled), 2 * data[17:2999])
    np.testing.assert_array_equal(cupy.asnumpy(rows), data[:2982])
    np.testing.assert_array_equal(cupy.asnumpy(block), data[5:3000, 3:500])
    assert dev.bytes_h2d == 2 * rows.nbytes + block.nbytes
    assert dev.copy_seconds()["h2d"] > 0


@pytest.mark.multi_gpu(2)
def test_distributed_matmul_from_files_writes_the_product_and_counts_pcie(tmp_path):
    m, k, n = 3000, 2500, 2100
    a, b, _ = npy_operands(tmp_path, m, k, n, seed=5, dtype=np.float32)
    out = tmp_path / "c.npy"
    params = {
        "input": {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")},
        "output": str(out),
        "operands": "distributed",
    }
    result = run_job(validate_job(_job("matmul", params, **gpu_workers(2))))
    assert result.status == "ok" and result.verify.passed
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(np.load(out) - ref).max() <= 1e-4 * np.abs(ref).max()
    # Each input crossed PCIe once (panels), the output once; B's other half came device to
    # device (NVLink, or within the GPU two workers share).
    assert result.pcie.bytes == result.pcie.minimum_bytes == 4 * (m * k + k * n + m * n)
    assert all(w.bytes_d2d == k * (n // 2) * 4 for w in result.per_worker)
    assert all(w.h2d_gbps and w.d2h_gbps for w in result.per_worker)


def _streamed_from_files(tmp_path, m, k, n, *, seed, limit):
    """A streamed float32 matmul of .npy files into an .npy C on GPU 0 under ``limit``: its
    result, once C is checked against NumPy's product in float64."""
    a, b, _ = npy_operands(tmp_path, m, k, n, seed=seed, dtype=np.float32)
    out = tmp_path / "c.npy"
    params = {
        "input": {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")},
        "output": str(out),
        "operands": "streamed",
    }
    result = run_job(validate_job(_job("matmul", params, devices=[0], memory_limit=limit)))
    assert result.status == "ok" and result.verify.passed
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(np.load(out) - ref).max() <= 1e-4 * np.abs(ref).max()
    return result


@pytest.mark.parametrize("limit", ["1GB", "50MB"])  # all of C kept; panels of it (C alone is 25 MB)
def test_streamed_matmul_from_files_on_one_gpu(tmp_path, limit):
    from mgpu.workloads.matmul import stream as matmul_stream

    m, k, n = 3000, 5000, 2100  # k in 3 blocks of B: the last blocks are finished band by band
    result = _streamed_from_files(tmp_path, m, k, n, seed=6, limit=limit)
    # What crossed PCIe is what the plan said: A and C once, B once per panel less what stayed.
    assert result.pcie.bytes == result.pcie.naive_bytes >= result.pcie.budget_minimum_bytes
    panels = -(-m // result.plan["tile_shape"]["m"])
    assert (panels == 1) == (limit == "1GB")
    if panels == 1:
        assert result.pcie.bytes == result.pcie.minimum_bytes == 4 * (m * k + k * n + m * n)
    assert matmul_stream.BLOCK_ROWS < k
    (t,) = result.timeline  # where the tile's time went (one tile streams every panel), the parts adding up to its span
    parts = (t.first_load_s, t.products_s, t.idle_s, t.write_tail_s)
    assert min(parts) >= 0 and sum(parts) == pytest.approx(t.span_s, abs=1e-6)
    assert t.span_s <= result.per_device[0].span_s + 1e-6 and t.products_s > 0 and t.pieces >= 2
    # The idle's causes, on the device's clock, are parts of the idle on the worker's.
    assert 0 <= t.idle_inputs_s + t.idle_writes_s + t.checks_s <= t.idle_s + 1e-3
    assert t.blocks_tflops > 0 and t.whole_k_tflops is None


# B (12-16 MB) whole beside four panels of 2250 rows: the first phase, two panels, bands;
# the later panels' products over all of k in one call, or in three pieces of k.
@pytest.mark.parametrize(
    "k,n,limit,piece", [(2000, 2000, "100MB", 0), (3000, 1000, "160MB", 0), (3000, 1000, "160MB", 1000)]
)
def test_streamed_matmul_keeping_b_whole_on_one_gpu(tmp_path, monkeypatch, k, n, limit, piece):
    from mgpu.workloads.matmul import stream as matmul_stream

    m = 9000
    if piece:  # the plan is made here, in the client
        monkeypatch.setattr(matmul_stream, "WHOLE_K_PIECE", piece)
    result = _streamed_from_files(tmp_path, m, k, n, seed=8, limit=limit)
    assert result.plan["tile_shape"]["k"] == k and result.plan["tile_shape"]["m"] < m // 2
    assert result.pcie.bytes == result.pcie.minimum_bytes == 4 * (m * k + k * n + m * n)
    (t,) = result.timeline
    assert t.blocks_tflops > 0 and t.whole_k_tflops > 0
    assert 0 <= t.idle_inputs_s + t.idle_writes_s + t.checks_s <= t.idle_s + 1e-3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_product_into_views_of_larger_arrays_equals_cupys(dtype):
    import cupy as cp

    rng = cp.random.default_rng(5)
    a, b = rng.standard_normal((300, 900)).astype(dtype), rng.standard_normal((700, 650)).astype(dtype)
    c = cp.full((400, 800), cp.nan, dtype=dtype)
    av, bv, cv = a[10:290, 100:700], b[50:650, 20:620], c[30:310, 90:690]  # rows contiguous, strides larger
    kernels.gemm_into(cp, av, bv, cv)
    ref = cp.matmul(cp.ascontiguousarray(av), cp.ascontiguousarray(bv))
    tol = 1e-12 if dtype == "float64" else 1e-4
    cp.testing.assert_allclose(cv, ref, rtol=tol, atol=tol * float(cp.abs(ref).max()))
    kernels.gemm_into(cp, av, bv, cv, accumulate=True)
    cp.testing.assert_allclose(cv, 2 * ref, rtol=tol, atol=2 * tol * float(cp.abs(ref).max()))
    assert bool(cp.isnan(c[:30]).all()) and bool(cp.isnan(c[:, 690:]).all())  # nothing outside the view
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.gemm_into(cp, av[:, ::2], bv[:300], cv[:, :300])


@pytest.mark.parametrize("method", ["pwrite", "mmap"])
def test_streamed_matmul_writes_c_by_either_method_on_one_gpu(tmp_path, method):
    import dask.config

    with dask.config.set({"mgpu.io.write": method, "mgpu.io.writers": 3}):
        result = _streamed_from_files(tmp_path, 2500, 4500, 1800, seed=7, limit="1GB")
    assert result.pcie.bytes == result.pcie.minimum_bytes


def test_a_dot_from_files_is_reduced_piece_by_piece_as_kvikio_reads(tmp_path, monkeypatch):
    pytest.importorskip("kvikio")
    from mgpu.tiling import Tile
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.workloads.dot import Dot, DotParams
    from mgpu.workloads.dot import workload as dot

    monkeypatch.setattr(dot, "_PIECE_BYTES", 1 << 20)  # 256 Ki float32 a piece: 8 pieces
    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    n = 2_000_003
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    job = Dot(DotParams(input={"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}))
    from mgpu.worker.tile import run_tile

    record = run_tile(job, dev, Tile(0, {"n": (5, n)}))
    want = float(np.dot(x[5:].astype(np.float64), y[5:].astype(np.float64)))
    assert record.verify_ok and abs(record.value - want) <= 1e-12 * float(np.dot(np.abs(x[5:]), np.abs(y[5:])))
    assert dev.bytes_h2d == 8 * (n - 5)


def test_dot_from_files_bigger_than_the_budget(tmp_path):
    n = 30_000_000  # 240 MB of x and y against a 64 MB budget: streamed in chunks
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    params = {"input": {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}}
    result = run_job(validate_job(_job("dot", params, devices=[0], memory_limit="64MB")))
    assert result.status == "ok" and result.verify.passed and result.plan["tiles"] >= 4
    want = float(np.dot(x.astype(np.float64), y.astype(np.float64)))
    assert abs(result.value - want) <= 1e-9 * float(np.dot(np.abs(x).astype(np.float64), np.abs(y)))
    assert result.pcie.bytes == result.pcie.minimum_bytes == 8 * n
    assert "h2d_pinned" in result.roofline.basis  # bound by PCIe, not by the device's memory


# -- the worker runtime -------------------------------------------------------------------


def test_closing_the_runtime_frees_its_pinned_buffers_panels_and_cache():
    import gc
    import weakref

    from mgpu.worker.runtime import Runtime, _cuda_device

    rt = Runtime(_cuda_device())
    staging = rt.device.staging
    staging.ready_buffers(1 << 20)
    assert staging.buffer_count == staging.threads
    buffers = [weakref.ref(b) for b in staging._made]
    rt.panels.keep("job", "a", cupy.ones((256, 256), cupy.float32))
    rt.device.cache.get("axes", "job", lambda: cupy.arange(10))
    rt.close()
    gc.collect()
    # Every thread's pinned buffers were let go and the pinned pool holds no free block.
    assert all(ref() is None for ref in buffers)
    assert cupy.get_default_pinned_memory_pool().n_free_blocks() == 0
    assert rt.panels.held() == 0 and len(rt.device.cache) == 0 and staging.buffer_count == 0


def _runtime_ids(dask_worker=None):
    import os

    from mgpu.worker.tasks import current

    rt = current(dask_worker)
    return id(rt), rt.device.facts.id, rt.device.is_gpu, rt.device.facts.uuid, os.getpid()


@pytest.mark.multi_gpu(2)
def test_each_gpu_worker_has_its_own_runtime():
    from distributed import Client

    from mgpu.worker.plugins import RuntimeSetup

    with cuda_cluster(2) as cluster, Client(cluster) as client:
        client.register_plugin(RuntimeSetup("cuda"))
        got = client.run(_runtime_ids)
        assert len(got) == 2 and all(gpu for _, _, gpu, _, _ in got.values())
        assert len({pid for *_, pid in got.values()}) == 2  # a process, a context and a runtime each
        ids = sorted(facts_id for _, facts_id, *_ in got.values())
        uuids = {uuid for _, _, _, uuid, _ in got.values()}
        assert all(u.startswith("GPU-") for u in uuids)
        if sharing_one_gpu(2):
            assert ids == [0, 0] and len(uuids) == 1
        else:
            assert ids == [0, 1] and len(uuids) == 2


def test_workers_sharing_a_gpu_run_under_an_mps_daemon_of_their_own_that_ends_with_the_cluster():
    import tempfile
    from pathlib import Path

    import psutil

    from mgpu import mps

    if mps.control_program() is None:
        pytest.skip(f"NVIDIA's {mps.CONTROL} is not installed")

    def daemons() -> set[int]:
        # A daemon that ended but was never reaped (a container's init may not) is gone too.
        found = psutil.process_iter(["name", "status"])
        return {p.pid for p in found if p.info["name"] == mps.CONTROL and p.info["status"] != psutil.STATUS_ZOMBIE}

    folders, running = set(Path(tempfile.gettempdir()).glob("mgpu-mps-*")), daemons()
    params = {"n": 60_000_000, "dtype": "float32"}
    under = run_job(validate_job(_job("dot", params, devices=[0], workers_per_device=3)))
    turns = run_job(validate_job(_job("dot", params, devices=[0], workers_per_device=3, mps=False)))
    assert under.verify.passed and turns.verify.passed and under.value == pytest.approx(turns.value, rel=1e-12)
    assert [(d["workers"], d["sharing"]) for d in under.devices] == [(3, "mps")]
    assert [(d["workers"], d["sharing"]) for d in turns.devices] == [(3, "turns")]
    assert len(under.per_worker) == 3 and all(w.tiles >= 1 for w in under.per_worker)
    # The daemon and its folder went with the cluster.
    assert set(Path(tempfile.gettempdir()).glob("mgpu-mps-*")) == folders
    wait_for(lambda: daemons() <= running, 10, "the cluster's MPS control daemon to end")
