"""What a job tells whoever watches it: the CLI's messages and progress bar, a notebook, a test."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..cluster import ClusterInfo
    from ..results import Result
    from ..spec import Job
    from ..tiling import Plan
    from ..workloads.base import TileRecord

__all__ = ["Events"]


class Events:
    """What the client side tells whoever watches (the CLI's messages and progress bar).

    Every method does nothing here; a watcher overrides those it needs.
    """

    def cluster_ready(self, info: ClusterInfo) -> None: ...

    def planned(self, plan: Plan) -> None: ...

    def tile_done(self, record: TileRecord) -> None: ...

    def panels_made(self, records: list[TileRecord]) -> None:
        """Every tile has ended; ``records`` are the makings of the plan's panels (if any)."""

    def worker_lost(self, worker: str, tiles: list[int], step: int | None = None) -> None:
        """``worker`` left mid-job; its ``tiles`` go to the others (a stepped job's tiles all
        step again from ``step``)."""

    def job_started(self, index: int, job: Job) -> None: ...

    def job_done(self, result: Result) -> None: ...

    def finished(self, info: ClusterInfo, result: Result) -> None:
        """The last job is done and its cluster still up (``submit --keep-open`` waits here)."""
