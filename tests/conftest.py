"""Shared test fixtures: a real small LocalCluster, the CLI through click's CliRunner,
job-file writing, the GPU test policy (one device count, the ``gpu`` and ``multi_gpu(n)``
markers) and a bounded wait on a condition."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mgpu.cli import cli

# -- the user's own state stays out -----------------------------------------------------
#
# mgpu's cache folder holds the measured ceilings and the record of a cluster `mgpu cluster up`
# left running, which `mgpu submit` joins. The tests, and every process they start, use a
# folder of their own, so a cluster the user keeps up is never what a test runs on.

_CACHE_HOME = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    folder = tempfile.mkdtemp(prefix="mgpu-tests-cache-")
    config.stash[_CACHE_HOME] = folder
    os.environ["XDG_CACHE_HOME"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CACHE_HOME in config.stash:
        shutil.rmtree(config.stash[_CACHE_HOME], ignore_errors=True)


# -- the GPU policy -------------------------------------------------------------------
#
# One device count decides every GPU skip: a test marked ``gpu`` is skipped without a GPU.
# A test marked ``multi_gpu(n)`` runs on n GPU workers: n GPUs where there are, else n
# workers sharing GPU 0 (``gpu_workers`` gives the cluster keys, ``cuda_cluster`` a cluster).
# Only ``separate_gpus(n)`` (the peer bandwidth itself) skips below n GPUs. A test of the
# CPU path does not skip on a GPU machine: it hides the GPUs with the ``no_gpu`` fixture.


@functools.cache
def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CuPy or a driver)."""
    from mgpu.gpus import cuda_count

    return cuda_count()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and gpu_count() == 0:
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("multi_gpu") is not None and gpu_count() == 0:
        pytest.skip("needs a CUDA GPU (its workers share it where there are fewer GPUs than workers)")
    for mark in item.iter_markers("separate_gpus"):
        n = mark.args[0] if mark.args else 2
        if gpu_count() < n:
            pytest.skip(f"needs {n} separate CUDA GPUs, this machine has {gpu_count()}")


def gpu_workers(n: int) -> dict[str, Any]:
    """The cluster keys of n GPU workers: one on each of n GPUs where there are n, else n
    sharing GPU 0."""
    if gpu_count() >= n:
        return {"devices": list(range(n))}
    return {"devices": [0], "workers_per_device": n}


def sharing_one_gpu(n: int) -> bool:
    """Whether :func:`gpu_workers` puts n workers on one GPU here."""
    return gpu_count() < n


def cuda_cluster(n: int, **kwargs: Any) -> Any:
    """A local cluster of n GPU workers (see :func:`gpu_workers`), no dashboard."""
    from mgpu.cuda_cluster import start_cuda_cluster

    keys = gpu_workers(n)
    return start_cuda_cluster(keys["devices"], keys.get("workers_per_device", 1), dashboard_address=None, **kwargs)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide every GPU from mgpu, in this process and in the processes it starts."""
    from mgpu.memory import bench

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # mgpu's device count and child processes
    # CuPy in this process may have counted the devices already; the bench asks CuPy.
    monkeypatch.setattr(bench, "_gpu_count", lambda: (0, "no CUDA GPU is visible"))


# -- waiting on a condition ------------------------------------------------------------

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 30, what: str = "the condition", interval: float = 0.05) -> T:
    """Call ``condition`` until it returns something true and return that.

    Raises
    ------
    TimeoutError
        When ``timeout`` seconds pass first; ``what`` names what was waited for.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(interval)  # the poll's period; the wait itself ends on the condition


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


def npy_operands(
    tmp: Path, m: int, k: int, n: int, *, seed: int, dtype: Any = np.float64
) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """Standard-normal A (m x k) and B (k x n) saved as ``a.npy`` and ``b.npy`` in ``tmp``:
    the arrays, and the ``input:`` that names the files."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k), dtype=dtype), rng.standard_normal((k, n), dtype=dtype)
    np.save(tmp / "a.npy", a)
    np.save(tmp / "b.npy", b)
    return a, b, {"a": str(tmp / "a.npy"), "b": str(tmp / "b.npy")}


def write_job(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def submit_json(job: Path, json_path: Path, *extra: Any) -> tuple[CliResult, dict[str, Any] | None]:
    """``mgpu submit JOB --json JSON -q EXTRA...``; returns the run and the parsed JSON (if any)."""
    res = invoke("submit", job, "--json", json_path, "-q", *extra)
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    return res, data
