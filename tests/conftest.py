"""Shared test fixtures: a real small LocalCluster, the CLI through click's CliRunner,
job-file writing, and the ``multi_gpu(n)`` skip helper."""

from __future__ import annotations

import inspect
import json
import logging
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from mgpu.cli import cli

# -- markers ------------------------------------------------------------------------


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CuPy or a driver)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def multi_gpu(n: int) -> pytest.MarkDecorator:
    """Mark a test ``multi_gpu(n)`` and skip it on machines with fewer than ``n`` GPUs."""

    def decorate(func: Any) -> Any:
        func = pytest.mark.multi_gpu(n)(func)
        return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA GPUs")(func)

    return decorate  # type: ignore[return-value]


# -- clusters -----------------------------------------------------------------------


def start_local_cluster(**kwargs: Any) -> Any:
    """A real LocalCluster of two single-threaded worker processes, no dashboard."""
    from distributed import LocalCluster

    with warnings.catch_warnings():
        # Without a dashboard the scheduler still serves /health on 8787 or, taken, any port.
        warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
        return LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            silence_logs=logging.WARNING,
            **kwargs,
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One LocalCluster per test module, shut down at the module's end."""
    c = start_local_cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def scheduler(cluster: Any) -> str:
    """The shared cluster's address, for ``submit --scheduler``."""
    return cluster.scheduler_address


# -- the CLI ------------------------------------------------------------------------


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _runner() -> CliRunner:
    # click < 8.2 mixes stderr into stdout unless told not to; 8.2+ keeps them apart.
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=False)
    return CliRunner()


def invoke(*args: Any) -> CliResult:
    """Run ``mgpu ARGS...`` in-process; an uncaught exception lands in stderr as its traceback."""
    result = _runner().invoke(cli, [str(a) for a in args], catch_exceptions=True)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return CliResult(result.exit_code, result.stdout, stderr)


@pytest.fixture
def run_cli() -> Callable[..., CliResult]:
    return invoke


# -- jobs ---------------------------------------------------------------------------


def write_job(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def submit_json(job: Path, json_path: Path, *extra: Any) -> tuple[CliResult, dict[str, Any] | None]:
    """``mgpu submit JOB --json JSON -q EXTRA...``; returns the run and the parsed JSON (if any)."""
    res = invoke("submit", job, "--json", json_path, "-q", *extra)
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    return res, data
