"""The steps of a stepped plan on the workers, their checkpoints, and how they resume
after a worker is lost.

Every step of every tile is submitted at once: a worker runs each as soon as what it waits
for has run. Every ``mgpu.recovery.checkpoint-steps`` steps (where the workload can save
its tiles' state, see :class:`~mgpu.workloads.base.Stepped`, and the job has more than one
worker) each tile saves its state in host memory, and the client keeps it as two Dask
results: one on the tile's worker, one on the next worker (its keeper). Once a newer
checkpoint of every tile is kept, the older ones are let go.

When a worker is lost, every tile goes back to the latest step of which a checkpoint of
every tile is still held by a worker left (step 0, from the inputs, where none is): the
lost worker's tiles move to the workers left, the others stay, and the steps from there
on are submitted again under a new token (what a step task still running of the old ones
does is then nobody's).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from distributed.comm import get_address_host

from ..tiling import Plan, Tile
from ..worker.tasks import drop_stepped, hand_over_checkpoint, keep_checkpoint, resume_tile, step_tile
from ..workloads.base import Stepped, Workload

__all__ = ["SteppedRun"]

# How long the workers left may take to drop the old steps' tiles (one that does not answer is left be).
_DROP_S = 10.0


class _StepsLost(logging.Filter):
    """Drops the scheduler's warning that a lost worker's steps and checkpoints of the job
    ``token`` "will be recomputed elsewhere": they are not (mgpu goes back to the copies
    left, and says so)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "caused the cluster to lose already computed" not in message:
            return True
        named = message.split("elsewhere:", 1)[-1].split("(stimulus_id", 1)[0]
        keys = re.findall(r"'([^']+)'", named)
        ours = rf"-(step|saved|lent|kept|resume)-\d+-\d+-{self.token}(-\d+)?$"
        return not keys or not all(re.search(ours, k) for k in keys)


@dataclass
class SteppedRun:
    """The step tasks of one stepped plan, submitted from the first step or from a checkpoint.

    Parameters
    ----------
    client
        The connected ``distributed.Client``.
    workload, plan
        The job's workload (a :class:`~mgpu.workloads.base.Stepped`) and its plan.
    token
        The job's token on the workers; each resumption takes another (see :attr:`tokens`).
    resources
        What each step task asks of its worker.
    devices
        Each worker's physical device: neighbours whose workers share one exchange on it.
    every
        Steps between checkpoints; 0: none (a resumption starts again from step 0).
    """

    client: Any
    workload: Workload
    plan: Plan
    token: str
    resources: dict[str, float] | None = None
    devices: Mapping[str, str] = field(default_factory=dict)
    every: int = 0
    tokens: list[str] = field(default_factory=list)  # every token the steps ran under, the current last
    last: dict[int, Any] = field(default_factory=dict)  # each tile's last step
    resumed_from: list[int] = field(default_factory=list)  # the step of each resumption
    where: dict[int, str] = field(default_factory=dict)  # each tile's worker now
    # step -> tile -> the futures of its checkpoint (on its worker, on its keeper)
    _saved: dict[int, dict[int, list[Any]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.where = {t.index: t.worker or "" for t in self.plan.tiles}
        self._quiet = _StepsLost(self.token)

    def start(self) -> dict[int, Any]:
        """Submit every step from the first; returns each tile's last step."""
        logging.getLogger("distributed.scheduler").addFilter(self._quiet)
        self._submit(0, {})
        return self.last

    def regroup(self, live: list[str]) -> dict[int, str] | None:
        """Submit the steps again on the workers in ``live`` from the latest step every
        tile's checkpoint survives; returns each tile's worker (None, submitting nothing,
        where every tile's worker is in ``live``)."""
        gone = [i for i, w in sorted(self.where.items()) if w not in live]
        if not gone:
            return None
        # Let go of the steps, not cancel them: a cancel reaches what depends on them, the
        # checkpoints among it. Those not needed are forgotten (never run, if not yet running).
        self.last = {}
        load = {w: sum(1 for x in self.where.values() if x == w) for w in live}
        for index in gone:  # to the least loaded; of those, one holding a neighbour
            near = {self.where[n] for t in self.plan.tiles if t.index == index for n in t.neighbours}
            worker = min(live, key=lambda w: (load[w], w not in near, live.index(w)))
            self.where[index] = worker
            load[worker] += 1
        # The old steps' tiles are nobody's now: their memory goes once their tasks end.
        with contextlib.suppress(Exception):
            self.client.run(drop_stepped, self.token, workers=live, on_error="ignore", callback_timeout=_DROP_S)
        step, saved = self._latest(set(live))
        self.resumed_from.append(step)
        self._submit(step, saved)
        return dict(self.where)

    def cancel(self) -> None:
        """Cancel the steps and let go of the checkpoints (a cancel of one would reach the
        other copy, which depends on it, and the scheduler asserts every key it reaches so
        is still wanted)."""
        with self._lock:
            self._saved.clear()
        self.client.cancel(list(self.last.values()))
        self.last = {}
        logging.getLogger("distributed.scheduler").removeFilter(self._quiet)

    # -- the steps -----------------------------------------------------------------------
    def _submit(self, first: int, saved: dict[int, Any]) -> None:
        """Submit steps ``first`` onward under a new token, each tile's state made from its
        checkpoint in ``saved`` (none at step 0: the tiles start from their inputs).

        Step s of a tile runs on the tile's worker after its own step s-1 and its
        neighbours' (what they sent is an argument); a neighbour on another worker gets its
        data device to device where both are GPUs of one host or its worker shares this
        one's GPU, through the host otherwise.
        """
        token = self.token = self.token if not self.tokens else f"{self.tokens[0]}-{len(self.tokens)}"
        self.tokens.append(token)
        name, where = self.workload.name, self.where
        tiles = [replace(t, worker=where[t.index]) for t in self.plan.tiles]
        remote = {t.index: frozenset(n for n in t.neighbours if where[n] != where[t.index]) for t in tiles}
        last: dict[int, Any] = {}
        for t in tiles if first else ():
            last[t.index] = self._task(
                resume_tile,
                self.workload,
                t,
                saved[t.index],
                token,
                remote[t.index],
                key=f"{name}-resume-{t.index}-{first}-{token}",
                worker=t.worker,
                priority=-first,
            )
        keepers = self._keepers()
        for step in range(first, self.plan.steps):
            save = bool(keepers) and self.every > 0 and (step + 1) % self.every == 0 and step + 1 < self.plan.steps
            now = {}
            for t in tiles:
                # Workers of one host: their GPUs may reach each other directly (mgpu.worker.exchange).
                peers = frozenset(
                    n for n in remote[t.index] if get_address_host(where[n]) == get_address_host(where[t.index])
                )
                mine = self.devices.get(where[t.index])
                same = frozenset(n for n in peers if mine is not None and self.devices.get(where[n]) == mine)
                now[t.index] = self._task(
                    step_tile,
                    self.workload,
                    t,
                    step,
                    token,
                    last.get(t.index),
                    [last[n] for n in t.neighbours if n in last],
                    remote[t.index],
                    peers,
                    same,
                    save,
                    key=f"{name}-step-{t.index}-{step}-{token}",
                    worker=t.worker,
                    priority=-step,
                )
                if save:
                    self._checkpoint(t, step + 1, now[t.index], keepers[where[t.index]])
            last = now
        self.last = last

    def _task(self, fn: Any, *args: Any, key: str, worker: str | None, priority: int) -> Any:
        # Only the last steps are held: an earlier one is let go once what needs it has run.
        return self.client.submit(
            fn,
            *args,
            key=key,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            resources=self.resources,
            priority=priority,
        )

    # -- checkpoints ---------------------------------------------------------------------
    def _keepers(self) -> dict[str, str]:
        """Each worker of the tiles -> the next one, which keeps a copy of its checkpoints
        (none with one worker, or a workload that cannot save its tiles)."""
        if not (isinstance(self.workload, Stepped) and self.workload.resumable):
            return {}
        workers = sorted(set(self.where.values()))
        if len(workers) < 2:
            return {}
        return {w: workers[(i + 1) % len(workers)] for i, w in enumerate(workers)}

    def _checkpoint(self, tile: Tile, step: int, after: Any, keeper: str) -> None:
        """Keep tile's checkpoint at ``step`` (saved by its step ``after``) on its worker and on ``keeper``.

        The keeper's copy is made from a second key on the tile's worker (the same data,
        no copy), which goes once that copy is made. Made from the tile's own copy, the
        keeper's fetch left a second replica of it, and Dask's active memory manager
        (``ReduceReplicas``) drops the replicas of a key no task waits for, at times the
        one on the tile's worker: both copies were then on the keeper, and a CPU test that
        lost the keeper lost the tile's checkpoint in 1 run of 8. Each copy is now a key
        with one replica; a lost keeper's copy is made again from the tile's own.
        """
        name, token = self.workload.name, self.token

        def on(worker: str | None, fn: Any, *args: Any, kind: str) -> Any:
            return self.client.submit(
                fn,
                *args,
                key=f"{name}-{kind}-{tile.index}-{step}-{token}",
                workers=[worker],
                allow_other_workers=False,
                pure=False,
                priority=-step,
            )

        own = on(tile.worker, hand_over_checkpoint, token, tile.index, step, after, kind="saved")
        kept = on(keeper, keep_checkpoint, on(tile.worker, keep_checkpoint, own, kind="lent"), kind="kept")
        with self._lock:
            self._saved.setdefault(step, {})[tile.index] = [own, kept]
        kept.add_done_callback(lambda fut: self._prune(step))

    def _prune(self, step: int) -> None:
        """Let go of the checkpoints before ``step`` once every tile's at ``step`` is kept twice."""
        with self._lock:
            copies = self._saved.get(step, {})
            if len(copies) < len(self.plan.tiles) or any(f.status != "finished" for fs in copies.values() for f in fs):
                return
            for older in [s for s in self._saved if s < step]:
                del self._saved[older]

    def _latest(self, live: set[str]) -> tuple[int, dict[int, Any]]:
        """The latest step of which every tile has a checkpoint on a worker in ``live``, and
        for each tile the copy to resume from (on its worker now, where one is); (0, {}) if none."""
        with self._lock:
            saved = {step: dict(copies) for step, copies in self._saved.items()}
        if not saved:
            return 0, {}
        # The scheduler says which copies are held, and where: a copy it holds is whole even
        # where this client has not yet heard that its task finished (a worker lost just
        # then left tiles with no copy finished here, and the job stepped again from step 0).
        futures = [f for copies in saved.values() for fs in copies.values() for f in fs]
        held = self.client.who_has(futures) if futures else {}
        for step in sorted(saved, reverse=True):
            chosen = {}
            for index, copies in saved[step].items():
                alive = [f for f in copies if live & set(held.get(f.key, ()))]
                here = [f for f in alive if self.where[index] in held.get(f.key, ())]
                if here or alive:
                    chosen[index] = (here or alive)[0]
            if len(chosen) == len(self.plan.tiles):
                with self._lock:  # the later ones (incomplete) and the older ones go
                    for other in [s for s in self._saved if s != step]:
                        del self._saved[other]
                return step, chosen
        with self._lock:
            self._saved.clear()
        return 0, {}
