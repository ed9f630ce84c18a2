"""GPU tests of Zarr stores: chunks reach device memory through KvikIO (in place) or from
maps of their chunks through pinned buffers, or decoded on the host; jobs from stores
equal the same jobs from .npy and allocate nothing more on the device; each GPU worker's
/metrics shows its pool by the GPU's UUID.

Run on a GPU machine with ``pytest -m gpu tests/test_zarr_gpu.py``.
"""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")
zarr = pytest.importorskip("zarr")

from conftest import npy_operands  # noqa: E402

from mgpu.client.run import run_job  # noqa: E402
from mgpu.spec import validate_job  # noqa: E402


def _job(workload: str, params: dict, **cluster) -> dict:
    return {
        "name": f"gpu-{workload}",
        "workload": workload,
        "params": params,
        "cluster": {"backend": "cuda", "dashboard": None, **cluster},
    }


def _store(path, arr, chunks, *, compressed=False):
    kw = {} if compressed else {"compressors": None}
    zarr.create_array(str(path), shape=arr.shape, chunks=chunks, dtype=arr.dtype, **kw)[...] = arr
    return str(path)


@pytest.mark.parametrize(
    "chunks,compressed",
    [
        ((128, 517), False),  # as wide as the array: whole-row blocks land in place
        ((100, 64), False),  # narrower: each piece's columns copied from a map of its chunk
        ((256, 256), True),  # zstd: decoded on the host, staged through pinned buffers
    ],
)
def test_store_blocks_reach_the_gpu(tmp_path, chunks, compressed):
    import dask.config

    pytest.importorskip("kvikio")
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.stores import ZarrSource, inspect_zarr

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    data = np.random.default_rng(2).standard_normal((3001, 517)).astype(np.float32)
    src = ZarrSource(inspect_zarr(_store(tmp_path / "a.zarr", data, chunks, compressed=compressed), key="a"))
    assert src.info.raw is not compressed
    with dask.config.set({"mgpu.io.task-size": "64KiB", "mgpu.io.threads": 4}):
        rows = src.read(dev, (17, 2999))
        block = src.read(dev, (5, 3000), (3, 500))
        with dev.on_stream():
            doubled = rows * 2
        src.read_into(dev, rows, (0, 2982))  # after the product that reads it, not before
    dev.synchronize()  # the staged pieces' copies are on the thread's stream
    np.testing.assert_array_equal(cupy.asnumpy(doubled), 2 * data[17:2999])
    np.testing.assert_array_equal(cupy.asnumpy(rows), data[:2982])
    np.testing.assert_array_equal(cupy.asnumpy(block), data[5:3000, 3:500])
    assert dev.bytes_h2d >= 2 * rows.nbytes + block.nbytes


def test_chunks_never_written_reach_the_gpu_as_the_fill_value(tmp_path):
    pytest.importorskip("kvikio")
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.stores import ZarrSource, inspect_zarr

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    z = zarr.create_array(
        str(tmp_path / "a.zarr"), shape=(300, 40), chunks=(64, 16), dtype="float64", compressors=None, fill_value=2.5
    )
    z[64:128] = 1.0
    got = ZarrSource(inspect_zarr(str(tmp_path / "a.zarr"), key="a")).read(dev, (10, 300), (3, 40))
    dev.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(got), z[10:300, 3:40])


def test_staged_pieces_land_in_blocks_of_a_wider_device_array(tmp_path):
    # Rows a pitch apart (2-D DMAs), whole rows, a single row and a vector, in chunks of
    # a few rows each, all at once.
    from mgpu.worker import transfer
    from mgpu.worker.device import Device, DeviceFacts

    dev = Device(
        "cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True)
    )
    host = np.random.default_rng(3).standard_normal((300, 700)).astype(np.float32)
    vector = np.arange(5000, dtype=np.float64)
    with dev.on_stream():
        out = cupy.full((300, 900), -1.0, dtype=cupy.float32)
        flat = cupy.zeros(6000, dtype=cupy.float64)
    pieces = [
        (out[:, 0:250], host[:, 100:350]),  # a column block into a column block
        (out[10:20, 300:900], host[50:60, 100:700]),
        (out[299:300, 250:300], host[0:1, :50]),  # one row
        (out[100:200], np.concatenate([host[100:200], host[100:200, :200]], axis=1)),  # whole rows
        (flat[1000:], vector),
    ]
    moved = transfer.Stager(dev, 4096).load_pieces(pieces)
    dev.synchronize()
    want = np.full((300, 900), -1.0, np.float32)
    want[:, 0:250] = host[:, 100:350]
    want[10:20, 300:900] = host[50:60, 100:700]
    want[299, 250:300] = host[0, :50]
    want[100:200] = np.concatenate([host[100:200], host[100:200, :200]], axis=1)
    np.testing.assert_array_equal(cupy.asnumpy(out), want)
    np.testing.assert_array_equal(cupy.asnumpy(flat)[1000:], vector)
    assert moved == dev.bytes_h2d == sum(src.nbytes for _, src in pieces)
    with pytest.raises(ValueError, match="contiguous rows"):
        transfer.Stager(dev).load_pieces([(out[:, ::2], host[:, :450])])


def test_streamed_matmul_from_stores_of_the_bench_layouts_allocates_what_the_npy_job_does(tmp_path):
    # Under 200 MB the schedule takes blocks of 1024 columns of A (half a chunk of 2048)
    # and keeps C: A's pieces and square chunks' B pieces are copied from the chunks'
    # maps, zstd chunks' from the decoded chunks; no device buffer beside the budget's
    # (it would spill to managed memory).
    m = k = n = 4096
    a, b, _ = npy_operands(tmp_path, m, k, n, seed=9, dtype=np.float32)
    layouts = {
        "npy": ({"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}, "c.npy"),
        "zarr": (
            {"a": _store(tmp_path / "a.zarr", a, (512, 2048)), "b": _store(tmp_path / "b.zarr", b, (2048, n))},
            "c.zarr",
        ),
        "square": (
            {"a": _store(tmp_path / "sa.zarr", a, (2048, 2048)), "b": _store(tmp_path / "sb.zarr", b, (2048, 2048))},
            "sc.zarr",
        ),
        "zstd": (  # decoded on the host, each chunk once, named ahead by the schedule
            {
                "a": _store(tmp_path / "za.zarr", a, (512, 2048), compressed=True),
                "b": _store(tmp_path / "zb.zarr", b, (2048, n), compressed=True),
            },
            "zc.zarr",
        ),
    }
    results = {}
    for name, (inputs, out) in layouts.items():
        params = {"input": inputs, "output": str(tmp_path / out), "operands": "streamed"}
        results[name] = run_job(validate_job(_job("matmul", params, devices=[0], memory_limit="200MB")))
        assert results[name].status == "ok" and results[name].verify.passed, name
    assert results["zarr"].plan["tile_shape"]["k"] == 1024  # blocks half a chunk of A wide
    npy_c = np.load(tmp_path / "c.npy")
    scale = np.abs(npy_c).max()
    for name, out in [("zarr", "c.zarr"), ("square", "sc.zarr"), ("zstd", "zc.zarr")]:
        got = zarr.open_array(str(tmp_path / out), mode="r")[...]
        np.testing.assert_allclose(got, npy_c, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
        assert results[name].spill == results["npy"].spill, name


@pytest.mark.parametrize("limit", ["1GB", "80MB"])  # all of C kept; panels of it
def test_streamed_matmul_from_stores_equals_the_npy_job(tmp_path, limit):
    m, k, n = 3000, 5000, 2100
    a, b, _ = npy_operands(tmp_path, m, k, n, seed=6, dtype=np.float32)
    stores = {
        "a": _store(tmp_path / "a.zarr", a, (512, 2048)),  # A's blocks are 2048 wide: in place
        "b": _store(tmp_path / "b.zarr", b, (1000, 700)),  # read across chunks, staged
    }
    files = {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}
    results = {}
    for name, inputs, out in [("zarr", stores, "c.zarr"), ("npy", files, "c.npy")]:
        params = {"input": inputs, "output": str(tmp_path / out), "operands": "streamed"}
        results[name] = run_job(validate_job(_job("matmul", params, devices=[0], memory_limit=limit)))
        assert results[name].status == "ok" and results[name].verify.passed
    c = zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[...]
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(c - ref).max() <= 1e-4 * np.abs(ref).max()
    np.testing.assert_allclose(c, np.load(tmp_path / "c.npy"), rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert results["zarr"].pcie.bytes >= results["npy"].pcie.bytes  # staged B chunk rows are whole


def test_per_tile_matmul_and_dot_from_zstd_stores(tmp_path):
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((1500, 900)), rng.standard_normal((900, 700))
    params = {
        "input": {
            "a": _store(tmp_path / "a.zarr", a, (333, 250), compressed=True),
            "b": _store(tmp_path / "b.zarr", b, (250, 333), compressed=True),
        },
        "output": str(tmp_path / "c.zarr"),
    }
    result = run_job(validate_job({**_job("matmul", params, devices=[0], memory_limit="20MB")}))
    assert result.status == "ok" and result.verify.passed and len(result.per_device) == 1
    np.testing.assert_allclose(zarr.open_array(str(tmp_path / "c.zarr"))[...], a @ b, rtol=1e-10, atol=1e-10)
    x, y = rng.standard_normal(1_000_003).astype(np.float32), rng.standard_normal(1_000_003).astype(np.float32)
    inputs = {
        "x": _store(tmp_path / "x.zarr", x, (65536,), compressed=True),
        "y": _store(tmp_path / "y.zarr", y, (65536,)),
    }
    dot = run_job(validate_job(_job("dot", {"input": inputs}, devices=[0])))
    assert dot.status == "ok" and dot.value == pytest.approx(
        float(np.dot(x.astype(np.float64), y.astype(np.float64))), rel=1e-9
    )


def test_a_gpu_workers_metrics_show_its_pool_by_the_gpus_uuid(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from mgpu.cluster import open_cluster, resolve_cluster

    job = validate_job(
        _job("matmul", {"m": 4096, "n": 4096, "k": 4096}, devices=[0], allocator="pool", memory_limit="2GB")
    )
    with open_cluster(resolve_cluster(job.cluster)) as info:
        result = run_job(job, client=info.client)
        assert result.status == "ok"
        (address, worker), *_ = info.client.scheduler_info(n_workers=-1)["workers"].items()
        host = address.split("://")[1].rsplit(":", 1)[0]
        with urllib.request.urlopen(f"http://{host}:{worker['services']['dashboard']}/metrics", timeout=10) as r:
            text = r.read().decode()
        uuid = info.devices[address].uuid  # the worker's GPU, as mgpu.gpus names it
    got = {
        s.name: s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("mgpu_gpu_pool")
    }
    assert set(got) == {"mgpu_gpu_pool_in_use_bytes", "mgpu_gpu_pool_peak_bytes", "mgpu_gpu_pool_size_bytes"}
    assert all(s.labels == {"gpu_uuid": uuid, "kind": "pool"} for s in got.values())
    assert uuid.startswith("GPU-")
    # A tile's blocks of A and B and its C were allocated at once at least.
    t = result.plan["tile_shape"]
    assert got["mgpu_gpu_pool_peak_bytes"].value >= 4 * (t["m"] * t["k"] + t["k"] * t["n"] + t["m"] * t["n"])
    assert got["mgpu_gpu_pool_size_bytes"].value >= got["mgpu_gpu_pool_peak_bytes"].value
    assert got["mgpu_gpu_pool_in_use_bytes"].value <= got["mgpu_gpu_pool_peak_bytes"].value
