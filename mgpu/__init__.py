"""mgpu: large array jobs on every GPU of a node, or CPU workers, on Dask."""

from __future__ import annotations

__version__ = "0.1.0"

from .client.run import run_job, run_jobs
from .errors import JobFailed, JobInputError
from .results import Result
from .spec import Job, load_job

__all__ = ["Job", "JobFailed", "JobInputError", "Result", "__version__", "load_job", "run_job", "run_jobs"]
