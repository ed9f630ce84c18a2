"""``mgpu bench alloc`` without a GPU: the exit-2 messages, the size checks, the record
without a GPU, and the bench's bookkeeping run against stand-ins for CuPy and RMM that check every buffer is
allocated before it is used and freed by the resource that made it."""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import invoke

from mgpu.errors import JobInputError
from mgpu.memory import bench as bench_alloc
from mgpu.memory.bench import ALLOCATORS, managed_limit, parse_sizes, spill_cap, summarise

ROOT = Path(__file__).resolve().parents[1]

# -- stand-ins for rmm.mr and cupy.cuda.runtime -------------------------------------------


class _Ledger:
    """Every live buffer, and every memset, across all fake resources."""

    def __init__(self) -> None:
        self.next = 1 << 20
        self.live: dict[int, tuple[int, object]] = {}  # ptr -> (bytes, the resource that made it)
        self.memsets = 0

    def new(self, nbytes: int, owner: object) -> int:
        ptr, self.next = self.next, self.next + nbytes + 256
        self.live[ptr] = (nbytes, owner)
        return ptr

    def free(self, ptr: int, nbytes: int, owner: object) -> None:
        assert self.live.pop(ptr) == (nbytes, owner), "freed by a resource that did not make it"


LEDGER = _Ledger()


class _Direct:
    def __init__(self) -> None:
        pass

    def allocate(self, nbytes: int, stream: object = None) -> int:
        return LEDGER.new(nbytes, self)

    def deallocate(self, ptr: int, nbytes: int, stream: object = None) -> None:
        LEDGER.free(ptr, nbytes, self)


class CudaMemoryResource(_Direct):
    pass


class CudaAsyncMemoryResource(_Direct):
    pass


class ManagedMemoryResource(_Direct):
    pass


class PoolMemoryResource(_Direct):
    def __init__(self, upstream: object, initial_pool_size: int, maximum_pool_size: int) -> None:
        assert initial_pool_size % 256 == 0 and maximum_pool_size % 256 == 0  # RMM insists
        self.upstream_mr, self.maximum, self.used = upstream, maximum_pool_size, 0

    def allocate(self, nbytes: int, stream: object = None) -> int:
        if self.used + nbytes > self.maximum:
            raise MemoryError("pool exhausted")  # what rmm::out_of_memory becomes in Python
        self.used += nbytes
        return super().allocate(nbytes, stream)

    def deallocate(self, ptr: int, nbytes: int, stream: object = None) -> None:
        self.used -= nbytes
        super().deallocate(ptr, nbytes, stream)


class CallbackMemoryResource:
    def __init__(self, allocate_func, deallocate_func) -> None:
        self.a, self.d = allocate_func, deallocate_func

    def allocate(self, nbytes: int, stream: object = None) -> int:
        return self.a(nbytes, stream)

    def deallocate(self, ptr: int, nbytes: int, stream: object = None) -> None:
        self.d(ptr, nbytes, stream)


def _memset(ptr: int, value: int, nbytes: int, stream: int) -> None:
    assert ptr in LEDGER.live and LEDGER.live[ptr][0] >= nbytes, "used a buffer that is not allocated"
    LEDGER.memsets += 1


def _module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_gpu(monkeypatch):
    """One 16 GiB GPU with 8 GiB free, as far as the bench can tell."""
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        deviceSynchronize=lambda: None,
        memsetAsync=_memset,
        memGetInfo=lambda: (8 << 30, 16 << 30),
        getDeviceProperties=lambda d: {"name": b"Fake GPU"},
    )
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda d: types.SimpleNamespace(use=lambda: None))
    mr = types.SimpleNamespace(
        CudaMemoryResource=CudaMemoryResource,
        CudaAsyncMemoryResource=CudaAsyncMemoryResource,
        ManagedMemoryResource=ManagedMemoryResource,
        PoolMemoryResource=PoolMemoryResource,
        CallbackMemoryResource=CallbackMemoryResource,
    )
    monkeypatch.setitem(sys.modules, "cupy", _module("cupy", cuda=cuda))
    monkeypatch.setitem(sys.modules, "rmm", _module("rmm", mr=mr))
    LEDGER.__init__()
    yield LEDGER
    assert LEDGER.live == {}, "the bench leaked buffers"


# -- the bench's bookkeeping -------------------------------------------------------------


def test_every_allocator_every_size_with_managed_kept_small(fake_gpu):
    sizes = [1 << 20, 64 << 20, 1 << 30]
    bench = bench_alloc.run_alloc_bench(device=0, sizes=sizes, iterations=3, repeats=2)
    assert [(r.allocator, r.size) for r in bench.rows] == [(a, s) for a in ALLOCATORS for s in sizes]
    assert bench.managed_limit == 256 << 20  # min(256 MiB, 8 GiB free / 16)
    for r in bench.rows:
        if ALLOCATORS[r.allocator][1] and r.size > bench.managed_limit:
            assert r.skipped and r.us is None and r.samples_us == []  # never a 1 GiB managed buffer
        else:
            assert r.skipped is None and len(r.samples_us) == 2 and r.us_min <= r.us <= r.us_max
            assert r.vs_cudamalloc is not None and r.vs_cudamalloc > 0
    # Three timed-or-warm-up passes of three cycles each, every buffer used once.
    measured = [r for r in bench.rows if r.us is not None]
    assert fake_gpu.memsets == len(measured) * 3 * 3
    assert bench.row("cudaMalloc", 1 << 20).vs_cudamalloc == 1.0
    assert set(bench.fallback_overhead_us) == {str(s) for s in sizes}


def test_fallback_path_really_falls_back_and_normal_path_does_not(fake_gpu):
    bench = bench_alloc.run_alloc_bench(device=0, sizes=[1 << 20, 64 << 20], iterations=4, repeats=3)
    for size in (1 << 20, 64 << 20):
        assert bench.row("fallback-spill", size).fallback_events == (3 + 1) * 4  # every allocation
        assert bench.row("fallback", size).fallback_events == 0
        assert bench.row("pool", size).fallback_events is None


def test_record_from_the_command_line(fake_gpu, tmp_path):
    res = invoke("bench", "alloc", "--sizes", "1MiB,2MiB", "--iterations", "2", "--repeats", "1", "--out", tmp_path)
    assert res.code == 0, res.output
    record = json.loads((tmp_path / "alloc.json").read_text())
    assert record["suite"] == "alloc" and record["options"]["sizes"] == [1 << 20, 2 << 20]
    data = record["alloc"]
    assert data["status"] == "ok" and data["sizes"] == [1 << 20, 2 << 20] and data["device"]["name"] == "Fake GPU"
    assert {r["allocator"] for r in data["rows"]} == set(ALLOCATORS)
    assert all(r["us"] > 0 and r["samples_us"] for r in data["rows"])
    assert "cudaMalloc" in res.stderr and "fallback-spill" in res.stderr
    assert "spill fallback wrapper at 1.00 MiB" in res.stderr


def test_a_size_near_the_free_memory_is_refused(fake_gpu):
    with pytest.raises(JobInputError, match="--sizes: 4.00 GiB is more than a quarter"):
        bench_alloc.run_alloc_bench(device=0, sizes=[4 << 30])


def test_a_device_that_does_not_exist(fake_gpu, tmp_path):
    res = invoke("bench", "alloc", "--device", "3", "--out", tmp_path)
    assert res.code == 2
    assert "--device: GPU 3 does not exist; this machine has 1 GPU(s), ids 0-0" in res.stderr
    assert "Traceback" not in res.output


def test_helpers():
    assert parse_sizes("1MiB, 64MiB,1GiB") == [1 << 20, 64 << 20, 1 << 30]
    assert parse_sizes("4096") == [4096]
    assert spill_cap(1 << 20) == 512 << 10 and spill_cap(100) == 256
    assert all(spill_cap(s) < s for s in (257, 1 << 20, 3 << 20))
    assert managed_limit(1 << 40) == 256 << 20 and managed_limit(1 << 30) == 64 << 20
    assert summarise([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)


@pytest.mark.parametrize("sizes", ["abc", "0", "1MiB,-1", ",", "0.5", "huge"])
def test_bad_sizes_name_the_option(sizes, tmp_path):
    res = invoke("bench", "alloc", "--sizes", sizes, "--out", tmp_path)
    assert res.code == 2
    assert "--sizes:" in res.stderr and "1MiB,64MiB,1GiB" in res.stderr and "tiny" in res.stderr
    assert "Traceback" not in res.output and not (tmp_path / "alloc.json").exists()


# -- without a GPU -----------------------------------------------------------------------


def test_without_a_gpu_the_record_says_why(tmp_path, no_gpu):
    res = invoke("bench", "alloc", "--out", tmp_path)
    assert res.code == 0, res.output
    record = json.loads((tmp_path / "alloc.json").read_text())
    assert record["alloc"]["status"].startswith("skipped: needs a GPU: ")
    assert record["options"]["backend"] == "cpu" and record["options"]["sizes"] == [64 << 10, 1 << 20]
    assert "alloc: skipped: needs a GPU" in res.stderr


def test_without_a_gpu_cuda_asked_for_exits_2(tmp_path, no_gpu):
    proc = subprocess.run(
        [sys.executable, "-m", "mgpu", "bench", "alloc", "--backend", "cuda", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("mgpu: error: --backend: cuda asked for; mgpu bench alloc needs a GPU: ")
    assert "Traceback" not in proc.stderr and not (tmp_path / "alloc.json").exists()


def test_bench_help_lists_alloc():
    res = invoke("bench", "-h")
    assert res.code == 0 and "alloc" in res.stdout
    res = invoke("bench", "alloc", "-h")
    assert res.code == 0
    for word in ("--device", "--sizes", "--iterations", "--repeats", "--out"):
        assert word in res.stdout
