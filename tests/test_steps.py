"""Stepped plans: tiles that keep their state on their worker and exchange with neighbours
at every step (the core's support, shown with a workload defined here)."""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict

from mgpu.client.submit import run_plan
from mgpu.cluster import open_cluster, resolve_cluster
from mgpu.errors import JobFailed
from mgpu.spec import ClusterSpec
from mgpu.tiling import Plan, Tile, assign_contiguous
from mgpu.worker import tasks
from mgpu.worker import tile as routine
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
    from mgpu.worker.device import Device, DeviceFacts

    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    wl = Relay(RelayParams(tiles=3, steps=3))
    plan = wl.plan({"w": None}, 1 << 20, {})
    steps = routine.StepStore()
    last: dict[int, routine.Sent] = {}
    for step in range(plan.steps):
        last = {
            t.index: routine.step_tile(
                wl,
                dev,
                t,
                step,
                "tok",
                last.get(t.index),
                [last[n] for n in t.neighbours if n in last],
                steps=steps,
                buffers=PeerBuffers(),
            )
            for t in plan.tiles
        }
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
