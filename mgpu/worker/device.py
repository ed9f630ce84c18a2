"""What a task sees on its worker: the array module, its stream, a timer, memory facts.

Each worker holds one :class:`Device`, in its runtime (:mod:`mgpu.worker.runtime`), made when the
worker starts and closed when it stops. Tasks are handed it and write ``dev.xp``
code that runs unchanged on NumPy (CPU workers) and CuPy (GPU workers); what only a GPU
has (streams, events, host<->device copies) is behind methods that are no-ops or plain
copies on the CPU.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import psutil

from . import kernels
from .transfer import HostStaging

__all__ = ["Device", "DeviceCache", "DeviceFacts", "Timing", "address_space_room"]

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceFacts:
    """The facts the planner and the result need about one worker's device."""

    backend: str  # "cuda" | "cpu"
    id: int  # CUDA device ordinal on its host, or the CPU worker's index
    name: str
    memory: int  # bytes the device has in total
    free: int  # bytes free when asked
    host: str
    compute_capability: str | None = None
    # The physical device: a GPU's (or MIG slice's) UUID, or a CPU worker's own name.
    # Workers that give the same one share the device (see mgpu.sharing).
    uuid: str = ""
    # Bytes the worker's allocator may hand out (its RMM pool's limit or size), where it has one.
    budget: int | None = None
    pid: int = 0  # the worker's process, which its tiles' records name
    # Its CUDA work goes to an MPS server (mgpu.mps): it shares the GPU without taking turns.
    mps: bool = False

    @property
    def physical(self) -> str:
        """The physical device's identity: its UUID, or its host and ordinal where none was given."""
        return self.uuid or f"{self.host}/{self.backend}-{self.id}"


@dataclass
class Timing:
    """Elapsed time of timed device work; see :meth:`Device.timer`."""

    value: float | None = None
    start: Any = None
    stop: Any = None

    @property
    def seconds(self) -> float:
        if self.value is None:
            import cupy

            self.stop.synchronize()
            self.value = cupy.cuda.get_elapsed_time(self.start, self.stop) / 1e3
        return self.value

    def since(self, earlier: Timing) -> float:
        """Seconds from the end of ``earlier``'s work to the start of this one's (on a GPU
        between their events, on the device's clock; on a CPU the wall clock)."""
        if isinstance(self.start, float):  # timed on a CPU
            return float(self.start - earlier.stop)
        import cupy

        self.start.synchronize()
        return cupy.cuda.get_elapsed_time(earlier.stop, self.start) / 1e3


class DeviceCache:
    """Arrays a job keeps on its device between tiles, one entry per slot.

    Asking a slot for another key replaces its entry: the next job's arrays replace the
    last job's, so a worker holds one job's at a time.
    """

    def __init__(self) -> None:
        self._slots: dict[str, tuple[Hashable, Any]] = {}
        self._lock = threading.Lock()

    def get(self, slot: str, key: Hashable, make: Callable[[], T]) -> T:
        """The entry of ``slot`` for ``key``, made by ``make()`` (once: other threads asking
        meanwhile wait for it) if the slot holds another key or none."""
        with self._lock:
            held = self._slots.get(slot)
            if held is None or held[0] != key:
                self._slots.pop(slot, None)  # the job before's goes first: its memory is needed
                held = self._slots[slot] = (key, make())
            return held[1]

    def held(self, slot: str) -> Any | None:
        """What ``slot`` holds now (for any key), or None."""
        with self._lock:
            held = self._slots.get(slot)
        return held[1] if held is not None else None

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()


@dataclass
class Device:
    """One worker's device, shared by the worker's task threads.

    Each thread gets its own non-blocking stream (made by ``new_stream``) and its own
    byte counters, so two tiles running at once on one GPU neither wait for each other's
    work nor count each other's copies. ``staging`` holds the host threads and pinned
    buffers that large copies go through (:mod:`mgpu.worker.transfer`); ``cache``, arrays a job
    keeps on the device between its tiles; ``extra``, references to what the memory
    plugins set up (the spill fallback, the allocator's statistics).
    """

    backend: str
    xp: Any
    facts: DeviceFacts
    new_stream: Callable[[], Any] | None = None
    new_queue: Callable[[], Any] | None = None  # the in_order stream; by default new_stream()
    extra: dict[str, Any] = field(default_factory=dict)
    staging: HostStaging = field(default_factory=HostStaging, repr=False)
    cache: DeviceCache = field(default_factory=DeviceCache, repr=False)
    _local: threading.local = field(default_factory=threading.local, repr=False)
    _shared: Any = field(default=None, repr=False)  # see in_order
    _shared_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def is_gpu(self) -> bool:
        return self.backend == "cuda"

    @property
    def stream(self) -> Any:
        """This thread's stream (None on a CPU)."""
        return self._thread_stream("stream")

    @property
    def copy_stream(self) -> Any:
        """This thread's second stream, for copies that overlap its compute (None on a CPU)."""
        return self._thread_stream("copy_stream")

    def _thread_stream(self, name: str) -> Any:
        if self.new_stream is None:
            return None
        stream = getattr(self._local, name, None)
        if stream is None:
            stream = self.new_stream()
            setattr(self._local, name, stream)
        return stream

    @property
    def bytes_h2d(self) -> int:
        """Bytes this thread copied host to device so far."""
        return getattr(self._local, "h2d", 0)

    @property
    def bytes_d2h(self) -> int:
        """Bytes this thread copied device to host so far."""
        return getattr(self._local, "d2h", 0)

    def _count(self, name: str, nbytes: int) -> None:
        setattr(self._local, name, getattr(self._local, name, 0) + nbytes)

    def count_copy(self, kind: str, nbytes: int, begin: Any, end: Any) -> None:
        """Count a staged copy (``kind`` "h2d" or "d2h") and keep its events, bracketing
        the DMA on its stream, for :meth:`copy_seconds`."""
        self._count(kind, nbytes)
        pending = getattr(self._local, "copies", None)
        if pending is None:
            pending = self._local.copies = []
        pending.append((kind, begin, end))

    def count_read(self, kind: str, nbytes: int, seconds: float) -> None:
        """Count a copy timed on the host (a KvikIO read or write, done when it returns)."""
        self._count(kind, nbytes)
        pending = getattr(self._local, "copies", None)
        if pending is None:
            pending = self._local.copies = []
        pending.append((kind, seconds, None))

    def copy_seconds(self) -> dict[str, float]:
        """Seconds per kind of the copies counted since the last call (waits for them): a
        staged copy's DMA time, a KvikIO read's wall time."""
        out = {"h2d": 0.0, "d2h": 0.0}
        for kind, begin, end in getattr(self._local, "copies", None) or []:
            if end is None:
                out[kind] += begin
                continue
            import cupy

            end.synchronize()
            out[kind] += cupy.cuda.get_elapsed_time(begin, end) / 1e3
        self._local.copies = []
        return out

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Make this thread's non-blocking stream current for CuPy calls inside."""
        stream = self.stream
        if stream is None:
            yield
        else:
            with stream:
                yield

    def synchronize(self) -> None:
        """Wait for the work this thread enqueued (not other threads' work)."""
        stream = self.stream
        if stream is not None:
            stream.synchronize()

    @contextlib.contextmanager
    def in_order(self) -> Iterator[Any]:
        """Run the device work enqueued inside on the device's one shared stream, in the
        order threads get there: after this thread's earlier work, before its later work.

        For kernels that fill the GPU (a Mandelbrot band): launched on each thread's own
        stream, bands started together shared the SMs and ended together, and the GPU
        idled while their threads checked them and fetched the next; queued in order,
        one band's kernel runs while the thread of the one before checks it. Yields the
        shared stream (None on a CPU), current inside; work inside must not wait.
        """
        mine = self.stream
        if mine is None:
            yield None
            return
        # The block only enqueues. It holds the lock, so no other thread's kernels get
        # between its work and the event after it (else it would wait for theirs too).
        with self._shared_lock:
            if self._shared is None:
                make = self.new_queue or self.new_stream
                assert make is not None  # a device that has streams was given new_stream
                self._shared = make()
            shared = self._shared
            shared.wait_event(mine.record())
            with shared:
                yield shared
            mine.wait_event(shared.record())

    @contextlib.contextmanager
    def timer(self, stream: Any = None) -> Iterator[Timing]:
        """Time the device work enqueued inside the block (on ``stream``, by default this
        thread's).

        On a GPU, CUDA events on the stream bracket the work and nothing waits at the
        end of the block, so host work placed after it overlaps with the device; reading
        ``.seconds`` waits for the work to finish. On a CPU it is the wall clock.
        """
        timing = Timing()
        if self.is_gpu:
            import cupy

            stream = stream or self.stream
            timing.start, timing.stop = cupy.cuda.Event(), cupy.cuda.Event()
            timing.start.record(stream)
            yield timing
            timing.stop.record(stream)
        else:
            timing.start = time.perf_counter()
            yield timing
            timing.stop = time.perf_counter()
            timing.value = timing.stop - timing.start

    def to_device(self, host: np.ndarray) -> Any:
        """Copy a host array to the device (a no-op on the CPU), counting the bytes."""
        if not self.is_gpu:
            return np.asarray(host)
        arr = self.xp.asarray(np.ascontiguousarray(host))
        self._count("h2d", arr.nbytes)
        return arr

    def to_host(self, arr: Any) -> np.ndarray:
        """Copy a device array to the host (a no-op on the CPU), counting the bytes."""
        if not self.is_gpu:
            return np.asarray(arr)
        with self.on_stream():  # the wait, then the copy: see mgpu.worker.kernels.to_host
            out = kernels.to_host(self.xp, arr)
        self._count("d2h", out.nbytes)
        return out

    def close(self) -> None:
        """Let go of what the device holds for its tasks: the host threads and pinned
        buffers, the cached arrays, the streams (the threads' streams go with the threads'
        state), and the references to the memory plugins' objects."""
        if self.is_gpu:
            self.xp.cuda.runtime.deviceSynchronize()  # nothing enqueued may outlive its arrays
        self.staging.close()
        self.cache.clear()
        with self._shared_lock:
            self._shared = None
        self._local = threading.local()
        self.extra.clear()

    def spill_counts(self) -> tuple[int, int]:
        """(events, bytes) allocated in managed memory so far because the budget was full."""
        fallback = self.extra.get("spill")
        return (fallback.events, fallback.bytes) if fallback is not None else (0, 0)


def address_space_room(memory: int) -> int:
    """``memory``, or less where this process's address-space limit (``ulimit -v``, which
    the workers it starts inherit) leaves less room than that beyond what it maps now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return memory
    return max(0, min(memory, soft - psutil.Process().memory_info().vms))
