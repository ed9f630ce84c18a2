"""A sustained ceiling is timed as mgpu.ceilings says: on a GPU its kernel runs back to back
for ``sustain`` seconds first, then as many calls again are timed in one block, whose mean
is the ceiling; with no window (or on a CPU) ``samples`` timed runs give the median. A
device whose timer reports what the test says stands for the GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import dask.config
import pytest

from mgpu.roofline import median_seconds, sustained_seconds


@dataclass
class _Timing:
    seconds: float = 0.0


@dataclass
class ScriptedDevice:
    """Runs nothing; each call of the kernel 'takes' ``seconds[i]`` (the i-th call's)."""

    is_gpu: bool
    seconds: list[float]
    calls: int = 0
    timed: list[list[int]] = field(default_factory=list)  # the calls each timed block held
    synced_after: list[int] = field(default_factory=list)

    def kernel(self) -> None:
        self.calls += 1

    @contextlib.contextmanager
    def timer(self) -> Iterator[_Timing]:
        timing = _Timing()
        before = self.calls
        yield timing
        self.timed.append(list(range(before + 1, self.calls + 1)))
        timing.seconds = sum(self.seconds[before : self.calls])

    def synchronize(self) -> None:
        self.synced_after.append(self.calls)


# (sustain, calls in the window): after the first call (untimed) each takes 1/16 s, so
# half a second is eight of them. Binary fractions: the sums are exact.
WINDOWS = [(0.5, 8), (1.0, 16), (0.03125, 1)]


@pytest.mark.parametrize("first", [0.0625, 0.5, 2.0])
@pytest.mark.parametrize("sustain,window_calls", WINDOWS)
def test_a_gpu_runs_the_kernel_for_the_window_then_times_as_many_calls_again(sustain, window_calls, first):
    # However long the first call takes (it may load its kernels): sized by a first call of
    # 2 s, the window held two calls, timed at once where it was meant for after half a second.
    dev = ScriptedDevice(is_gpu=True, seconds=[first] + [0.0625] * 200)
    with dask.config.set({"mgpu.ceilings.sustain": f"{sustain}s", "mgpu.ceilings.samples": 7}):
        mean = sustained_seconds(dev, dev.kernel)
    assert dev.timed[0] == [2]  # the first call untimed, the second timed, to size the rest
    batch = [list(range(3, window_calls + 2))] if window_calls > 1 else []  # enqueued at once
    # then one timed block of as many calls, straight after: samples does not apply
    assert dev.timed[1:] == [*batch, list(range(window_calls + 2, 2 * window_calls + 2))]
    assert dev.calls == 1 + 2 * window_calls
    assert mean == 0.0625


def test_a_batch_that_came_short_is_followed_by_another():
    # The sized batch ran faster than the call that sized it: 7 calls of 1/32 s left the
    # device busy 0.28 s of 0.5; seven more make up the rest.
    dev = ScriptedDevice(is_gpu=True, seconds=[0.5, 0.0625] + [0.03125] * 100)
    with dask.config.set({"mgpu.ceilings.sustain": "0.5s"}):
        assert sustained_seconds(dev, dev.kernel) == 0.03125
    assert dev.timed[:3] == [[2], list(range(3, 10)), list(range(10, 17))]
    assert dev.timed[3:] == [list(range(17, 32))]  # the window: as many calls as the 0.5 s took


def test_the_mean_of_the_timed_calls_is_kept_not_a_median():
    # The clocks swing at the power limit: a median of the timed calls would read 0.125 s.
    dev = ScriptedDevice(is_gpu=True, seconds=[0.5] + [0.125] * 3 + [0.125, 0.125, 0.5])
    with dask.config.set({"mgpu.ceilings.sustain": "0.375s"}):
        assert sustained_seconds(dev, dev.kernel) == 0.25
    assert dev.timed[-1] == [5, 6, 7]


def test_no_window_keeps_the_median_of_the_samples():
    dev = ScriptedDevice(is_gpu=True, seconds=[0.1, 0.2, 0.9, 0.3, 0.25, 0.4])
    with dask.config.set({"mgpu.ceilings.sustain": 0, "mgpu.ceilings.samples": 5}):
        assert sustained_seconds(dev, dev.kernel) == 0.3  # median of calls 2-6, after one untimed
    assert dev.timed == [[2], [3], [4], [5], [6]]


def test_a_cpu_has_no_window():
    dev = ScriptedDevice(is_gpu=False, seconds=[1.0] * 10)
    with dask.config.set({"mgpu.ceilings.sustain": "10s", "mgpu.ceilings.samples": 3}):
        sustained_seconds(dev, dev.kernel)
    assert dev.calls == 4 and dev.timed == [[2], [3], [4]] and dev.synced_after == []


def test_median_seconds_leaves_out_the_untimed_call_when_told():
    dev = ScriptedDevice(is_gpu=True, seconds=[0.1] * 10)
    with dask.config.set({"mgpu.ceilings.samples": 2}):
        median_seconds(dev, dev.kernel, first=False)
    assert dev.timed == [[1], [2]]


def test_every_dtype_s_gemm_ceiling_is_a_sustained_one(monkeypatch):
    # float32's too: its CUDA cores' clocks fall at the power limit as the tensor cores' do
    # (a cold median read 1.5% above the sustained mean on one H200).
    import numpy as np

    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.workloads.matmul import workload

    timed: list[object] = []  # each GEMM handed to the sustained timing

    def spy(dev: object, fn: object) -> float:
        timed.append(fn)
        return 1.0

    monkeypatch.setattr(workload, "sustained_seconds", spy)
    cpu = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    rates = workload.Matmul.measure_ceilings(cpu)
    assert len(timed) == len(rates) == 3  # float32, TF32, float64 (no float16 BLAS on a CPU)
    side = workload._CEILING_SIDE["cpu"]
    assert rates["gemm_float32"] == 2 * side**3 / 1e12  # the spy's second, not a median of runs
