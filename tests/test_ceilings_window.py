"""A sustained ceiling is timed as mgpu.ceilings says: on a GPU its kernel runs back to back
for ``sustain`` seconds first, then ``samples`` timed runs give the median; a CPU has no
window. A device whose timer reports what the test says stands for the GPU."""

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
    timed: list[int] = field(default_factory=list)  # which calls were timed
    synced_after: list[int] = field(default_factory=list)

    def kernel(self) -> None:
        self.calls += 1

    @contextlib.contextmanager
    def timer(self) -> Iterator[_Timing]:
        timing = _Timing()
        before = self.calls
        yield timing
        assert self.calls == before + 1, "one call per timed block"
        self.timed.append(self.calls)
        timing.seconds = self.seconds[self.calls - 1]

    def synchronize(self) -> None:
        self.synced_after.append(self.calls)


# (sustain, samples, calls in the window): the first call takes 0.1 s and is timed to size
# the window; the rest take 0.05 s, so 0.3 s is that call and two more.
WINDOWS = [(0.3, 3, 3), (1.0, 5, 10), (0.05, 1, 2)]


@pytest.mark.parametrize("sustain,samples,window_calls", WINDOWS)
def test_a_gpu_runs_the_kernel_for_the_window_then_times_the_samples(sustain, samples, window_calls):
    dev = ScriptedDevice(is_gpu=True, seconds=[0.1] + [0.05] * 200)
    with dask.config.set({"mgpu.ceilings.sustain": f"{sustain}s", "mgpu.ceilings.samples": samples}):
        median = sustained_seconds(dev, dev.kernel)
    assert dev.timed[0] == 1  # the first call is timed, to size the window
    assert dev.synced_after == [window_calls]  # the window's calls, enqueued back to back
    assert dev.timed[1:] == list(range(window_calls + 1, window_calls + 1 + samples))
    assert dev.calls == window_calls + samples  # no untimed call between window and samples
    assert median == 0.05


def test_the_median_of_the_samples_is_kept():
    dev = ScriptedDevice(is_gpu=True, seconds=[0.1, 0.2, 0.9, 0.3, 0.25, 0.4])
    with dask.config.set({"mgpu.ceilings.sustain": 0, "mgpu.ceilings.samples": 5}):
        assert sustained_seconds(dev, dev.kernel) == 0.3  # median of calls 2-6, after one untimed
    assert dev.timed == [2, 3, 4, 5, 6]


def test_a_cpu_has_no_window():
    dev = ScriptedDevice(is_gpu=False, seconds=[1.0] * 10)
    with dask.config.set({"mgpu.ceilings.sustain": "10s", "mgpu.ceilings.samples": 3}):
        sustained_seconds(dev, dev.kernel)
    assert dev.calls == 4 and dev.timed == [2, 3, 4] and dev.synced_after == []


def test_median_seconds_leaves_out_the_untimed_call_when_told():
    dev = ScriptedDevice(is_gpu=True, seconds=[0.1] * 10)
    with dask.config.set({"mgpu.ceilings.samples": 2}):
        median_seconds(dev, dev.kernel, first=False)
    assert dev.timed == [1, 2]
