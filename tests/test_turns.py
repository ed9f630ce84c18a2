"""Workers that share a GPU take turns at it: one process's work on the device at a time,
its threads together, each turn ending once its work has run (mgpu.worker.turns)."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from typing import Any

from mgpu.worker.turns import DeviceTurns

HOLD_S = 0.3  # how long the first process holds its turn: time enough for the other to barge in


class _Log:
    """Events of several processes in the order they happened: each takes a number from
    one shared counter as it happens (a queue alone orders them as its feeder threads
    write, which may be later)."""

    def __init__(self, ctx: Any) -> None:
        self.queue, self.count = ctx.Queue(), ctx.Value("i", 0)

    def put(self, event: str) -> None:
        with self.count.get_lock():
            self.count.value += 1
            self.queue.put((self.count.value, event))

    def events(self, n: int) -> list[str]:
        return [event for _, event in sorted(self.queue.get(timeout=5) for _ in range(n))]


def _hold(device: str, shared: bool, log: _Log, other_waiting: Any) -> None:
    turns = DeviceTurns(device, drain=lambda: log.put("A drained"))
    turns.shared = shared
    with turns.turn():
        log.put("A in")
        other_waiting.set()
        time.sleep(HOLD_S)
        log.put("A leaving")


def _enter(device: str, shared: bool, log: _Log, other_waiting: Any, patience: float) -> None:
    turns = DeviceTurns(device, drain=lambda: None, patience=patience)
    turns.shared = shared
    other_waiting.wait()
    with turns.turn():
        log.put("B in")


def _order(shared: bool, patience: float = 30.0) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    log, waiting = _Log(ctx), ctx.Event()
    device = f"GPU-test-{uuid.uuid4()}"
    procs = [
        ctx.Process(target=_hold, args=(device, shared, log, waiting)),
        ctx.Process(target=_enter, args=(device, shared, log, waiting, patience)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    return log.events(4 if shared else 3)


def test_a_process_waits_for_the_turn_of_another_on_the_same_gpu_until_its_work_has_run():
    assert _order(shared=True) == ["A in", "A leaving", "A drained", "B in"]


def test_a_gpu_no_other_worker_shares_is_never_waited_for():
    assert _order(shared=False) == ["A in", "B in", "A leaving"]


def test_a_turn_held_past_the_patience_of_another_process_is_not_waited_for():
    # A worker stopped (SIGSTOP) in its turn holds it: the others go on, time-sliced.
    assert _order(shared=True, patience=HOLD_S / 10) == ["A in", "B in", "A leaving", "A drained"]


def test_a_process_takes_turns_again_after_giving_up_on_one():
    device = f"GPU-test-{uuid.uuid4()}"
    other = DeviceTurns(device, drain=lambda: None)
    other.shared = True
    mine = DeviceTurns(device, drain=lambda: None, patience=0.05)
    mine.shared = True
    # The same process stands in for two: each DeviceTurns opens the lock file of its own.
    with other.turn():
        with mine.turn():
            given_up = other._owned and not mine._owned
    assert given_up
    with mine.turn():  # the lock free again: taken, and held while inside
        assert mine._owned
    assert not mine._owned
    other.close()
    mine.close()


def test_the_threads_of_one_process_share_its_turn_and_the_last_one_out_drains():
    events: list[str] = []
    turns = DeviceTurns(f"GPU-test-{uuid.uuid4()}", drain=lambda: events.append("drained"))
    turns.shared = True
    first_in, second_in = threading.Event(), threading.Event()

    def first() -> None:
        with turns.turn():
            first_in.set()
            assert second_in.wait(10)  # the second gets in while the first holds the turn
            events.append("first out")

    def second() -> None:
        assert first_in.wait(10)
        with turns.turn():
            events.append("second in")
            second_in.set()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    turns.close()
    assert events.index("second in") < events.index("first out")  # both inside at once
    assert events.count("drained") == 1 and events[-1] == "drained"  # once, when both were out


def test_a_tile_holds_its_turn_from_its_first_work_on_the_device_until_that_work_has_run():
    # What the host does after (the deferred verdict, the record) runs outside the turn,
    # while another worker has its.
    import contextlib

    import numpy as np

    from mgpu.spec import validate_job
    from mgpu.tiling import Tile
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.tile import run_tile
    from mgpu.workloads import get_workload_class

    events: list[str] = []
    cls = get_workload_class("mandelbrot")

    class Logged(cls):  # type: ignore[misc, valid-type]
        def run(self, ctx: Any, tile: Tile) -> Any:
            events.append("run")
            return super().run(ctx, tile)

        def check(self, ctx: Any, tile: Tile, answer: Any) -> Any:
            events.append("check")
            return lambda: (events.append("verdict"), (0.0, True))[1]

    @contextlib.contextmanager
    def turn() -> Any:
        events.append("turn")
        yield
        events.append("turn ends")

    params = validate_job({"workload": "mandelbrot", "params": dict(cls.example)}).params
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    record = run_tile(Logged(params, verify=True), dev, Tile(1, {"rows": (4, 12)}), turn=turn)
    assert events == ["turn", "run", "check", "turn ends", "verdict"] and record.verify_ok is True
    # Its record tells when the turn came and ended: the wait for it shows, and the work in it.
    marks = record.marks
    assert record.start <= marks["turn"] <= marks["turn_done"] <= marks["checked"] <= record.stop
