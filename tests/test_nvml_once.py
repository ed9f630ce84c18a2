"""NVML is initialised once in a process and left so: every question mgpu asks it (the
count, the GPUs, the driver, the links) after the first costs no new init, and dask-cuda's
own inits only count one more. A stand-in pynvml counts the calls."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from mgpu import gpus


class FakeNvml:
    """pynvml with two GPUs, counting inits and shutdowns; the first ``fail`` inits fail."""

    NVML_FEATURE_ENABLED = 1

    class NVMLError(Exception):
        pass

    def __init__(self, fail: int = 0) -> None:
        self.inits = self.shutdowns = 0
        self.fail = fail

    def nvmlInit(self) -> None:
        if self.fail:
            self.fail -= 1
            raise self.NVMLError("driver not loaded")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=80 << 30, free=79 << 30)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return 9, 0

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.1"

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        if link >= 2:
            raise self.NVMLError("no such link")
        return 1


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(fail: int = 0) -> FakeNvml:
        fake = FakeNvml(fail)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus._nvml.cache_clear()
    yield install
    gpus._nvml.cache_clear()  # the next test's NVML is its own


def test_every_question_after_the_first_reuses_the_one_init(fake_nvml):
    fake = fake_nvml()
    assert gpus.visible_count() == 2
    assert [g.uuid for g in gpus.nvml_gpus()] == ["GPU-0", "GPU-1"]
    assert gpus.nvml_gpus([1])[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus.driver_version() == "580.1"
    assert gpus.nvlink_links(2) == {"0": 2, "1": 2}
    assert gpus.visible_count() == 2
    assert (fake.inits, fake.shutdowns) == (1, 0)


def test_an_init_that_failed_is_tried_again(fake_nvml):
    fake = fake_nvml(fail=1)
    assert gpus.visible_count() == 0  # no driver: no GPU, and no error
    assert gpus.driver_version() == "580.1"  # asked again: now it starts
    assert gpus.visible_count() == 2
    assert fake.inits == 1
