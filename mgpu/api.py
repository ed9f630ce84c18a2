"""``mgpu.run``: the one entry for programs, notebooks and the command line."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .client.watch import Events
from .errors import JobInputError
from .spec import Job, apply_overrides, load_job, validate_job

if TYPE_CHECKING:
    from distributed import Client

    from .results import Result

__all__ = ["JobLike", "as_job", "run", "run_all"]

#: A job as :func:`run` takes it: the model, a job document, or the path of a job file.
JobLike = Job | Mapping[str, Any] | str | os.PathLike[str]


def as_job(job: JobLike, overrides: Sequence[str] = ()) -> Job:
    """``job`` validated into a :class:`~mgpu.spec.Job`, with ``overrides`` applied.

    Parameters
    ----------
    job
        A :class:`~mgpu.spec.Job`; a mapping with the keys of a job file (``workload``,
        ``params``, ...); or the path of a YAML job file.
    overrides
        ``"key.sub=value"`` strings, applied in order, as ``submit --set`` does.

    Raises
    ------
    JobInputError
        If the file is missing or malformed, or a key is wrong (the message names it).
    """
    if isinstance(job, Job):
        if not overrides:
            return job
        job = job.as_dict() | {"force": job.force}
    if isinstance(job, Mapping):
        return validate_job(apply_overrides(dict(job), list(overrides)))
    if isinstance(job, (str, os.PathLike)):
        return load_job(os.fspath(job), list(overrides))
    raise JobInputError(
        f"job: expected a Job, a mapping of a job's keys or the path of a job file, got {type(job).__name__}"
    )


def run(
    job: JobLike,
    client: Client | None = None,
    *,
    overrides: Sequence[str] = (),
    events: Events | None = None,
    security: Any = None,
) -> Result:
    """Run one job to completion and return its :class:`~mgpu.results.Result`.

    Parameters
    ----------
    job
        The job: a :class:`~mgpu.spec.Job`, a mapping with a job file's keys, or the
        path of a YAML job file.
    client
        A connected ``distributed.Client`` to run on, left open afterwards. Without one,
        the cluster the job's ``cluster:`` section describes is started (or joined) and
        closed when the job ends.
    overrides
        ``"key.sub=value"`` strings applied to the job (``submit --set``).
    events
        Told what happens as it happens (cluster ready, plan, each tile, lost workers);
        subclass :class:`~mgpu.client.watch.Events` for a progress bar.
    security
        A ``distributed.security.Security`` for joining a scheduler over TLS.

    Returns
    -------
    Result
        What ``submit --json`` writes, typed. A failed check does not raise: its
        ``status`` is ``"failed"``.

    Raises
    ------
    JobInputError
        The job cannot run as written; raised before any worker starts (except a tile
        that cannot fit the workers' memory, raised before any task runs).
    JobFailed
        A task failed, or every worker was lost.
    """
    return run_all([job], client, overrides=overrides, events=events, security=security)[0]


def run_all(
    jobs: Sequence[JobLike],
    client: Client | None = None,
    *,
    overrides: Sequence[str] = (),
    events: Events | None = None,
    security: Any = None,
) -> list[Result]:
    """Run ``jobs`` one after another on one cluster (see :func:`run`); returns their Results.

    Every job is checked before anything starts; their ``cluster:`` sections must agree.
    A job whose check fails ends the run: later jobs are not run, and the list is shorter.
    """
    if isinstance(jobs, (str, os.PathLike, Mapping, Job)):
        raise JobInputError("jobs: expected a list of jobs; for one job, call mgpu.run")
    if not jobs:
        raise JobInputError("jobs: no job was given")
    # Dask's client is imported when a job runs: importing mgpu.api stays light.
    from .client.run import run_jobs

    return run_jobs([as_job(j, overrides) for j in jobs], events, security=security, client=client)
