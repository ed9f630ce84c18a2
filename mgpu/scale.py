"""The scaling sweep: one job on several device counts (and sizes, and workers per device),
run by ``mgpu scale`` and by the harness's ``mgpu bench`` suites.

Strong scaling keeps the problem fixed; weak scaling (``--weak``) grows the params the
job's ``scale.grow`` names (or the workload's default) so the work grows with the device
count; ``--sizes`` sweeps problem sizes. Every run is planned and validated before the
first cluster starts, so a wrong size or count stops the sweep with nothing run. Each run
starts a cluster of its own, or the runs of one layout (device count and workers per
device) share one; each run's Result carries its own verification. Efficiency against
the fewest devices is :func:`mgpu.report.efficiency`, which reading saved results shares.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .client.run import run_jobs
from .client.watch import Events
from .cluster import resolve_cluster
from .errors import JobFailed, JobInputError
from .gpus import visible_count
from .results import Result
from .spec import Job, load_job
from .workloads import get_workload_class
from .workloads.base import Workload

__all__ = [
    "Outcome",
    "Run",
    "counts_up_to",
    "default_counts",
    "parse_counts",
    "parse_sizes",
    "plan_sweep",
    "run_sweep",
]

# Why a run of a shared cluster has no result when the one before it failed.
NOT_RUN = "not run: a job before it on its cluster failed"


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
    workers: int = 1  # worker processes sharing each device


@dataclass(frozen=True)
class Outcome:
    """What one run of a sweep gave: its Result, or why it has none (``keep_going`` sweeps)."""

    run: Run
    result: Result | None
    error: str | None = None

    @property
    def verified(self) -> bool:
        """The run finished and every tile's check passed."""
        return self.result is not None and self.result.status == "ok"


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


def counts_up_to(most: int) -> list[int]:
    """1, 2, 4, ... up to ``most``, and ``most`` itself: ``6`` -> ``[1, 2, 4, 6]``."""
    most = max(1, most)
    return sorted({*(1 << i for i in range(most.bit_length())), most})


def default_counts(backend: str, most: int | None = None) -> list[int]:
    """1, 2, 4, ... up to every visible GPU (or CPU core), that count included; with
    ``most``, up to no more than that many."""
    available = visible_count() if backend == "cuda" else (os.cpu_count() or 1)
    return counts_up_to(min(available, most) if most else available)


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
    workers: Sequence[int] | None = None,
) -> list[Run]:
    """Every run of the sweep, in order (sizes, then device counts, then workers per
    device, then repeats), validated.

    ``workers`` lists the numbers of workers sharing each device to run at every count;
    without it each count runs with the job's ``cluster.workers_per_device``.

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

    mode = "weak" if weak else "strong"
    runs = []
    for base in bases:
        for n in counts:
            size = _grown(base, grow, n) if weak else dict(base)
            sized = [f"params.{k}={v}" for k, v in size.items()] if weak or sizes else []
            for w in workers or [0]:
                shared = [f"cluster.workers_per_device={w}"] if w else []  # 0: the job's own
                run_overrides = [*overrides, *sized, f"cluster.devices={n}", *shared]
                run_job_ = load_job(job_file, run_overrides)
                # A count past the GPUs here fails now, not midway; CPU workers are one a core.
                per_device = resolve_cluster(run_job_.cluster).workers_per_device
                runs += [Run(run_job_, n, r, size, base, mode, run_overrides, per_device) for r in range(repeat)]
    return runs


def _sizes_of(cls: type[Workload], params: dict[str, object]) -> dict[str, int]:
    return {k: v for k in cls.size_params if isinstance(v := params.get(k), int)}


def run_sweep(
    runs: Sequence[Run],
    events: Events | None = None,
    *,
    force: bool = False,
    one_cluster: bool = False,
    keep_going: bool = False,
) -> Iterator[Outcome]:
    """Run each in turn, each on a cluster of its own, yielding its outcome as its cluster ends.

    A job's first run replaces existing outputs only with ``force`` (or the job's own
    ``force``); its later runs replace those the sweep itself wrote. With ``one_cluster``
    the runs next to each other on the same layout (device count and workers per device)
    share one cluster, so what each adds to its tiles' time is the per-job overhead alone;
    a run that fails ends its cluster's batch. With ``keep_going`` a run that fails is
    yielded with its error and the sweep goes on.

    Raises
    ------
    JobInputError
        As :func:`mgpu.run`; the runs already yielded stand.
    JobFailed
        A run failed, unless ``keep_going``; the runs already yielded stand.
    """
    jobs: list[Job] = []
    seen: set[str] = set()
    for run in runs:
        # A job's later runs replace the outputs its first run wrote.
        jobs.append(run.job.model_copy(update={"force": force or run.job.force or run.job.name in seen}))
        seen.add(run.job.name)
    for batch in _batches(runs, one_cluster):
        try:
            results, error = run_jobs([jobs[i] for i in batch], events), None
        except JobFailed as e:
            if not keep_going:
                raise
            results, error = [], str(e)
        for i, result in zip(batch, [*results, *[None] * (len(batch) - len(results))], strict=True):
            yield Outcome(runs[i], result, None if result is not None else error or NOT_RUN)


def _batches(runs: Sequence[Run], one_cluster: bool) -> list[list[int]]:
    """The indices of the runs each cluster runs: one each, or each layout's neighbours."""
    batches: list[list[int]] = []
    for i, run in enumerate(runs):
        prev = runs[i - 1] if i else None
        if one_cluster and prev is not None and (prev.devices, prev.workers) == (run.devices, run.workers):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
