"""``mgpu scale``: one job on several device counts (and sizes), a fresh cluster for each run.

Strong scaling keeps the problem fixed; weak scaling (``--weak``) grows the params the
job's ``scale.grow`` names (or the workload's default) so the work grows with the device
count; ``--sizes`` sweeps problem sizes. Every run is planned and validated before the
first cluster starts, so a wrong size or count stops the sweep with nothing run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .client.run import run_job
from .client.watch import Events
from .cluster import resolve_cluster
from .errors import JobInputError
from .gpus import visible_count
from .results import Result
from .spec import Job, load_job
from .workloads import get_workload_class
from .workloads.base import Workload

__all__ = ["Run", "default_counts", "parse_counts", "parse_sizes", "plan_sweep", "run_sweep"]


@dataclass(frozen=True)
class Run:
    """One run of a sweep: the job as it will run, and where it sits in the sweep."""

    job: Job
    devices: int
    repeat: int  # 0-based
    size: dict[str, int]  # the size params this run uses
    base_size: dict[str, int]  # the size before weak scaling grew it (= size otherwise)
    mode: str  # "strong" | "weak"
    overrides: list[str] = field(default_factory=list)


def parse_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: device counts, each at least 1, no repeats.

    Raises
    ------
    JobInputError
        Naming ``--devices`` and what it accepts.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise JobInputError(f"--devices: expected device counts of 1 or more like 1,2,4; got {text!r}")
    counts = [int(p) for p in parts]
    if len(set(counts)) != len(counts):
        raise JobInputError(f"--devices: a count repeats in {text!r}; use --repeat to run a count again")
    return sorted(counts)


def default_counts(backend: str) -> list[int]:
    """1, 2, 4, ... up to every visible GPU (or CPU core), that count included."""
    available = visible_count() if backend == "cuda" else (os.cpu_count() or 1)
    counts = [1 << i for i in range(max(1, available).bit_length()) if 1 << i <= available]
    return sorted({*counts, max(1, available)})


_NUMBER = re.compile(r"^\d+(\.\d+)?([eE]\d+)?$")


def _size_value(text: str) -> int:
    """``4096``, ``1e8`` or ``2.5e9`` -> an integer (what a size param takes)."""
    text = text.strip().replace("_", "")
    if not _NUMBER.match(text) or float(text) != int(float(text)) or float(text) < 1:
        raise ValueError(text)
    return int(float(text)) if "e" in text.lower() or "." in text else int(text)


def parse_sizes(text: str) -> tuple[list[str], list[int]]:
    """``"m,n,k=2048,4096"`` -> ``(["m", "n", "k"], [2048, 4096])``: every key takes each value.

    Keys may be written with their ``params.`` prefix. Values are integers, ``1e8`` allowed.

    Raises
    ------
    JobInputError
        Naming ``--sizes`` and its form.
    """
    keys_text, sep, values_text = text.partition("=")
    keys = [k.strip().removeprefix("params.") for k in keys_text.split(",") if k.strip()]
    form = "KEY[,KEY...]=VALUE,VALUE,... e.g. params.n=1e8,2e8 or m,n,k=2048,4096"
    if not sep or not keys:
        raise JobInputError(f"--sizes: expected {form}; got {text!r}")
    try:
        values = [_size_value(v) for v in values_text.split(",") if v.strip()]
    except ValueError as e:
        raise JobInputError(f"--sizes: {str(e)!r} is not a whole number of 1 or more; expected {form}") from None
    if not values:
        raise JobInputError(f"--sizes: no values after '='; expected {form}")
    return keys, values


def _grown(base: dict[str, int], grow: tuple[str, ...] | list[str], factor: int) -> dict[str, int]:
    # Together the grown keys multiply the work by ``factor``: each by its len(grow)-th root.
    each = factor ** (1 / len(grow))
    return {k: (max(1, round(v * each)) if k in grow else v) for k, v in base.items()}


def plan_sweep(
    job_file: str | Path,
    counts: list[int],
    repeat: int,
    *,
    weak: bool = False,
    sizes: tuple[list[str], list[int]] | None = None,
    overrides: list[str] | None = None,
) -> list[Run]:
    """Every run of the sweep, in order (sizes, then device counts, then repeats), validated.

    Raises
    ------
    JobInputError
        If the job, an override, a size or the weak-scaling keys are wrong, or the job
        joins a running scheduler (a sweep needs a fresh cluster per device count).
    """
    overrides = list(overrides or [])
    job = load_job(job_file, overrides)
    if job.cluster.scheduler:
        raise JobInputError(
            "cluster.scheduler: scale starts a fresh cluster for each device count and "
            "cannot join a running scheduler; remove the key (or --set cluster.scheduler=null)"
        )
    cls = get_workload_class(job.workload)
    params = job.params.model_dump(mode="json")
    if (weak or sizes) and params.get("input", "random") != "random":
        raise JobInputError(
            f"params.input: the input files fix the sizes of {job.workload}; "
            f"{'--weak' if weak else '--sizes'} needs input: random"
        )
    if sizes:
        keys, values = sizes
        bad = [k for k in keys if k not in cls.size_params]
        if bad:
            raise JobInputError(
                f"--sizes: {bad[0]!r} is not a size of {job.workload}; allowed: {', '.join(cls.size_params) or 'none'}"
            )
        bases = [{**_sizes_of(cls, params), **{k: v for k in keys}} for v in values]
    else:
        bases = [_sizes_of(cls, params)]
    grow = tuple(job.scale.grow or cls.grow)
    if weak and not grow:
        raise JobInputError(f"--weak: {job.workload} names no size to grow; set scale.grow in the job file")

    runs = []
    for base in bases:
        for n in counts:
            size = _grown(base, grow, n) if weak else dict(base)
            run_overrides = overrides + [f"params.{k}={v}" for k, v in size.items()] + [f"cluster.devices={n}"]
            run_job_ = load_job(job_file, run_overrides)
            resolve_cluster(run_job_.cluster)  # a count past the GPUs here fails now, not midway
            for r in range(repeat):
                runs.append(Run(run_job_, n, r, size, base, "weak" if weak else "strong", run_overrides))
    return runs


def _sizes_of(cls: type[Workload], params: dict[str, object]) -> dict[str, int]:
    return {k: v for k in cls.size_params if isinstance(v := params.get(k), int)}


def run_sweep(runs: list[Run], events: Events | None = None, *, force: bool = False) -> Iterator[tuple[Run, Result]]:
    """Run each in turn, each on a cluster of its own, yielding its result as it ends.

    The first run replaces existing outputs only with ``force``; later runs replace those
    the sweep itself wrote.

    Raises
    ------
    JobInputError, JobFailed
        As :func:`mgpu.run`; the runs already yielded stand.
    """
    for i, run in enumerate(runs):
        job = run.job.model_copy(update={"force": force or i > 0})
        yield run, run_job(job, events)
