"""The client imports no GPU library: importing mgpu, its command line, its API and the
client package leaves CuPy, RMM, NVML, dask-cuda and KvikIO unimported, even where they
are installed (here: empty stand-ins on the path, so the test means the same without a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GPU_LIBRARIES = ("cupy", "cupyx", "rmm", "pynvml", "dask_cuda", "kvikio", "numba")
CLIENT = ("mgpu", "mgpu.cli", "mgpu.api", "mgpu.client", "mgpu.background", "mgpu.cluster_cli")


def stand_ins(folder: Path) -> dict[str, str]:
    """An environment whose path finds an importable, empty package for each GPU library."""
    for name in GPU_LIBRARIES:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text("")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def gpu_modules_after(code: str, env: dict[str, str]) -> list[str]:
    """The GPU libraries imported once ``code`` has run in a fresh interpreter (a None in
    sys.modules is an import refused, not made)."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m, mod in sys.modules.items() "
        f"if m.split('.')[0] in {GPU_LIBRARIES!r} and mod is not None)))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_client_imports_no_gpu_library(tmp_path):
    env = stand_ins(tmp_path / "site")
    # The stand-ins are found: were any module to import them, the test would see it.
    assert gpu_modules_after("import cupy, rmm", env) == ["cupy", "rmm"]
    assert gpu_modules_after("\n".join(f"import {m}" for m in CLIENT), env) == []


# What a submit never uses: the result's table and the progress bar (-q draws neither; they
# are imported where they are drawn), notebooks' HTML templates, Dask's collections, plots,
# the commands for reading results and benchmarking.
UNUSED_BY_SUBMIT = (
    "rich.progress",
    "rich.table",
    "mgpu.show",
    "jinja2",
    "dask.array",
    "dask.dataframe",
    "pandas",
    "matplotlib",
    "bokeh",
    "scipy",
    "mgpu.plots",
    "mgpu.report",
    "mgpu.scale",
    "mgpu.bench",
)


def test_the_submit_path_imports_only_what_a_quiet_submit_uses():
    probe = (
        "import sys\nsys.orig_argv = [sys.executable, '-m', 'mgpu', 'submit', 'job.yaml']\n"
        "import mgpu.cli, mgpu.api, mgpu.background, mgpu.client.run, mgpu.client.preflight\n"
        "import mgpu.workloads.matmul, mgpu.workloads.dot, mgpu.workloads.mandelbrot\n"
        f"print(sorted(m for m in {UNUSED_BY_SUBMIT!r} if sys.modules.get(m) is not None))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
