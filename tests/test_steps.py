"""Stepped plans: tiles that keep their state on their worker and exchange with neighbours
at every step (the core's support, shown with a workload defined here)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import cloudpickle
import dask
import numpy as np
import pytest
from conftest import wait_for
from pydantic import BaseModel, ConfigDict

from mgpu.client.steps import SteppedRun
from mgpu.client.submit import run_plan
from mgpu.cluster import open_cluster, resolve_cluster
from mgpu.errors import JobFailed
from mgpu.spec import ClusterSpec
from mgpu.tiling import Plan, Tile, assign_contiguous
from mgpu.worker import tasks
from mgpu.worker import tile as routine
from mgpu.worker.device import Device, DeviceFacts
from mgpu.worker.exchange import PeerBuffers
from mgpu.workloads.base import Stepped, Workload

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import the tests


class RelayParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tiles: int = 5
    steps: int = 4


class Relay(Workload, Stepped):
    """Tile i starts at i + 1; at every step it adds what its neighbours held a step before."""

    name = "relay"
    Params = RelayParams
    unit = "GB/s"
    unit_scale = 1e9
    axes = ()
    verify_method = "recomputed"

    def plan(self, devices: dict, budget: int, tiling: dict, *, spill: bool = False) -> Plan:
        n = self.params.tiles
        owners = assign_contiguous(n, list(devices))
        tiles_ = [
            Tile(i, {"i": (i, i + 1)}, owners[i], neighbours=tuple(j for j in (i - 1, i + 1) if 0 <= j < n))
            for i in range(n)
        ]
        return Plan(tiles_, "static", {"i": 1}, 8, budget, steps=self.params.steps)

    def ceiling(self) -> str:
        return "copy"

    def start(self, ctx: Any, tile: Tile) -> dict:
        return {"value": np.array([tile.index + 1.0]), "seen": []}

    def step(self, ctx: Any, tile: Tile, step: int, received: dict) -> dict:
        state = ctx.state
        state["seen"].append((step, sorted(received)))
        state["value"] = state["value"] + sum(received.values(), np.zeros(1))
        ctx.record.work += 1.0
        return {n: state["value"].copy() for n in tile.neighbours}

    def save(self, ctx: Any, tile: Tile) -> dict:
        return {"value": ctx.state["value"].copy(), "seen": list(ctx.state["seen"])}

    def restore(self, ctx: Any, tile: Tile, step: int, saved: dict) -> dict:
        ctx.state = {"value": saved["value"].copy(), "seen": list(saved["seen"])}
        return {n: ctx.state["value"].copy() for n in tile.neighbours}

    def run(self, ctx: Any, tile: Tile) -> dict:
        return ctx.state

    def check(self, ctx: Any, tile: Tile, answer: dict) -> tuple[float, bool]:
        return 0.0, True

    def store(self, ctx: Any, tile: Tile, answer: dict) -> bool:
        ctx.record.value = float(answer["value"][0])
        ctx.record.extra["seen"] = answer["seen"]
        return False


def _relay(n: int, steps: int) -> np.ndarray:
    """What every tile holds after ``steps`` steps: the values after step s-1 (or the start)
    travel to the neighbours and are added at step s."""
    value = np.arange(1.0, n + 1)
    sent = np.zeros(n)
    for _ in range(steps):
        got = np.zeros(n)
        got[1:] += sent[:-1]
        got[:-1] += sent[1:]
        value = value + got
        sent = value.copy()
    return value


def test_steps_in_one_process_keep_state_and_pass_what_neighbours_sent():
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    wl = Relay(RelayParams(tiles=3, steps=3))
    plan = wl.plan({"w": None}, 1 << 20, {})
    steps = routine.StepStore()
    last = _steps(wl, plan, dev, steps, 0, {})
    assert steps.held() == 3
    records = [routine.run_tile(wl, dev, t, token="tok", stepped=last[t.index], steps=steps) for t in plan.tiles]
    assert [r.value for r in records] == list(_relay(3, 3))
    assert records[1].extra["seen"] == [(0, []), (1, [0, 2]), (2, [0, 2])]
    assert all(r.work == 3.0 and r.verify_ok for r in records)
    assert steps.held() == 0 and steps.release("tok") == 0  # each tile's state went with its end
    with pytest.raises(RuntimeError, match="state is not on this worker"):
        routine.run_tile(wl, dev, plan.tiles[0], token="tok", stepped=last[0], steps=steps)


def test_release_drops_one_jobs_stepped_tiles_only():
    steps = routine.StepStore()
    kept: Any = {key: object() for key in [("a", 0), ("a", 1), ("b", 0)]}  # stand for tiles' contexts
    for (token, index), ctx in kept.items():
        steps.keep(token, index, ctx)
    assert steps.release("a") == 2
    assert steps.held() == 1 and steps.get("b", 0) is kept["b", 0]
    assert steps.pop("a", 0) is None


def _stepped_tiles_held(dask_worker: Any) -> int:
    return tasks.current(dask_worker).steps.held()


def test_a_stepped_plan_on_two_workers_exchanges_through_dask(scheduler):
    wl = Relay(RelayParams(tiles=5, steps=6))
    with open_cluster(resolve_cluster(ClusterSpec(scheduler=scheduler, dashboard=None))) as info:
        plan = wl.plan(info.devices, 1 << 20, {})
        assert len({t.worker for t in plan.tiles}) == 2  # some neighbours are on the other worker
        records = run_plan(info.client, wl, plan)
        held = info.client.run(_stepped_tiles_held)
    assert sorted((r.index, r.value) for r in records) == list(enumerate(_relay(5, 6)))
    assert all(r.work == 6.0 for r in records)
    assert set(held.values()) == {0}  # nothing is left on the workers


def test_a_step_that_fails_fails_the_job(scheduler):
    class Broken(Relay):
        def step(self, ctx: Any, tile: Tile, step: int, received: dict) -> dict:
            if step == 2 and tile.index == 1:
                raise ValueError("step 2 broke")
            return super().step(ctx, tile, step, received)

    wl = Broken(RelayParams(tiles=3, steps=4))
    with open_cluster(resolve_cluster(ClusterSpec(scheduler=scheduler, dashboard=None))) as info:
        with pytest.raises(JobFailed, match="step 2 broke"):
            run_plan(info.client, wl, wl.plan(info.devices, 1 << 20, {}))
        held = info.client.run(_stepped_tiles_held)
    assert set(held.values()) == {0}


def _steps(wl: Relay, plan: Plan, dev: Any, store: routine.StepStore, first: int, last: dict, save_at: int = 0) -> dict:
    """Steps ``first`` onward of ``plan`` in this process; with ``save_at``, the state after that many is saved."""
    for step in range(first, plan.steps):
        last = {
            t.index: routine.step_tile(
                wl,
                dev,
                t,
                step,
                "tok",
                last.get(t.index),
                [last[n] for n in t.neighbours if n in last],
                save=step + 1 == save_at,
                steps=store,
                buffers=PeerBuffers(),
            )
            for t in plan.tiles
        }
    return last


def test_tiles_resumed_from_a_checkpoint_on_another_device_end_as_if_never_stopped():
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    wl = Relay(RelayParams(tiles=4, steps=7))
    plan = wl.plan({"w": None}, 1 << 20, {})
    store = routine.StepStore()
    _steps(wl, plan, dev, store, 0, {}, save_at=3)
    saved = [store.take("tok", t.index, 3) for t in plan.tiles]
    first = {t.index: store.get("tok", t.index).record for t in plan.tiles}
    # The state went on past step 3 after the save: the checkpoint kept it as it was.
    assert [c.state["value"][0] for c in saved] == list(_relay(4, 3))
    assert all(c.work == 3.0 and c.start == first[c.index].start for c in saved)

    other = Device("cpu", np, DeviceFacts("cpu", 1, "cpu", 1 << 30, 1 << 30, "h"))
    fresh = routine.StepStore()  # the first worker's tiles are gone
    resumed = {c.index: routine.resume_tile(wl, other, plan.tiles[c.index], c, "tok", steps=fresh) for c in saved}
    last = _steps(wl, plan, other, fresh, 3, resumed)
    records = [routine.run_tile(wl, other, t, token="tok", stepped=last[t.index], steps=fresh) for t in plan.tiles]
    assert [r.value for r in records] == list(_relay(4, 7))
    # Each record counts the whole tile's work (7 steps) from its first step's start.
    assert all(r.work == 7.0 and r.start == first[r.index].start for r in records)
    assert records[1].extra["seen"] == [(0, []), *((s, [0, 2]) for s in range(1, 7))]
    assert fresh.held() == 0


def test_a_workload_that_saves_nothing_is_not_resumable():
    class Plain(Relay):
        save = Stepped.save  # type: ignore[assignment]

    assert Relay(RelayParams()).resumable and not Plain(RelayParams()).resumable


def _checkpoints_held(dask_worker: Any) -> int:
    return len(tasks.current(dask_worker).steps._saved)


def test_checkpoints_are_kept_on_two_workers_and_the_steps_regroup_from_the_latest(scheduler):
    wl = Relay(RelayParams(tiles=4, steps=7))
    with open_cluster(resolve_cluster(ClusterSpec(scheduler=scheduler, dashboard=None))) as info:
        client = info.client
        plan = wl.plan(info.devices, 1 << 20, {})
        workers = sorted({t.worker for t in plan.tiles})
        run = SteppedRun(client, wl, plan, "ckpt", every=2)
        last = run.start()
        client.gather(list(last.values()))

        # Checkpoints after steps 2 and 4 were made; the newest set (6) was kept twice, the older let go.
        def kept() -> list[list[str]]:
            return client.run_on_scheduler(
                lambda dask_scheduler: sorted(
                    str(k).split("-")[:4] for k, ts in dask_scheduler.tasks.items() if "-kept-" in str(k)
                )
            )

        newest = [["relay", "kept", str(i), "6"] for i in range(4)]
        with contextlib.suppress(TimeoutError):  # the older are let go as the newest are kept
            wait_for(lambda: kept() == newest, 10, "the older checkpoints let go")
        assert kept() == newest
        # Each tile's two copies stay on two workers, whatever the scheduler's active memory
        # manager drops: no key of them has a replica it could drop in favour of the other.
        saved = run._saved[6]
        client.amm.run_once()
        held = client.who_has([f for fs in saved.values() for f in fs])
        for own, kept_copy in saved.values():
            assert held[own.key] == (run.where[int(own.key.split("-")[2])],) and len(held[kept_copy.key]) == 1
            assert held[own.key] != held[kept_copy.key]
        # Lose (as far as the steps know) the second worker: every tile goes back to step 6,
        # its tiles on the first worker, restored from the copies kept there.
        placement = run.regroup([workers[0]])
        assert placement == {t.index: workers[0] for t in plan.tiles}
        assert run.resumed_from == [6] and run.tokens == ["ckpt", "ckpt-1"]
        futures = [
            client.submit(tasks.run_tile, wl, t, None, run.token, run.last[t.index], workers=[workers[0]], pure=False)
            for t in plan.tiles
        ]
        records = client.gather(futures)
        assert [r.value for r in records] == list(_relay(4, 7))
        assert all(r.work == 7.0 for r in records)
        run.cancel()
        for token in run.tokens:
            client.run(tasks.end_job, token, "close")
        assert set(client.run(_checkpoints_held).values()) == {0}
        assert set(client.run(_stepped_tiles_held).values()) == {0}


def test_a_stepped_plan_with_checkpoints_gives_the_same_answer(scheduler):
    wl = Relay(RelayParams(tiles=5, steps=6))
    with dask.config.set({"mgpu.recovery.checkpoint-steps": 2}):
        with open_cluster(resolve_cluster(ClusterSpec(scheduler=scheduler, dashboard=None))) as info:
            records = run_plan(info.client, wl, wl.plan(info.devices, 1 << 20, {}))
            held = info.client.run(_checkpoints_held)
    assert sorted((r.index, r.value) for r in records) == list(enumerate(_relay(5, 6)))
    assert set(held.values()) == {0}


def test_the_schedulers_warning_of_lost_steps_is_dropped_for_this_jobs_keys_only():
    import logging

    from mgpu.client.steps import _StepsLost

    def passes(keys: str, token: str = "ab12cd") -> bool:
        message = (
            "Removing worker 'tcp://127.0.0.1:1' caused the cluster to lose already computed task(s), which "
            f"will be recomputed elsewhere: {{{keys}}} (stimulus_id='handle-worker-cleanup-1.5')"
        )
        record = logging.LogRecord("distributed.scheduler", logging.WARNING, __file__, 1, message, None, None)
        return _StepsLost(token).filter(record)

    assert not passes(
        "'stencil-step-1-185-ab12cd', 'stencil-kept-0-150-ab12cd', 'stencil-lent-1-150-ab12cd', 'stencil-saved-2-50-ab12cd-1'"
    )
    assert passes("'stencil-step-1-185-ab12cd', 'matmul-tile-3-ab12cd'")  # a key of something else: said
    assert passes("'stencil-step-1-185-ab12cd'", token="ffffff")  # another job's
    other = logging.LogRecord("distributed.scheduler", logging.WARNING, __file__, 1, "another warning", None, None)
    assert _StepsLost("ab12cd").filter(other)
