"""``mgpu bench suite``: mgpu's device-resident jobs, each against its roofline.

Every job generates its operands on the devices; each result's ``roofline`` is the sum
over the devices used of one device's ceiling for that job, measured once in this run
(the harness points ``mgpu.cache-dir`` at a fresh folder, so no cached ceiling is used,
unless ``--cached-ceilings``). ``--job FILE`` adds a job file of the user's, at the size
it is written for: a workload from a plug-in is measured by the same harness.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import dask.config
import yaml

from .harness import BenchInputError, Options, resolve, run_jobs, summarize

# name -> (workload, params per preset); TF32 and the distributed operands are GPU-only figures.
SIZES = {
    "tiny": {"matmul": 256, "dot": 100_000, "mandelbrot": 256, "max_iter": 50},
    "small": {"matmul": 8192, "dot": 200_000_000, "mandelbrot": 16384, "max_iter": 1000},
    "full": {"matmul": 32768, "dot": 2_000_000_000, "mandelbrot": 65536, "max_iter": 1000},
}


def jobs(sizes: str, backend: str) -> list[tuple[str, dict[str, Any]]]:
    """The suite's jobs at a size preset: (name, job document)."""
    s = SIZES[sizes]
    n = s["matmul"]
    mm = {"m": n, "n": n, "k": n, "dtype": "float32"}
    side = s["mandelbrot"]
    mb = {"width": side, "height": side, "max_iter": s["max_iter"], "output": None}
    out = [
        ("matmul-float32", {"workload": "matmul", "params": mm}),
        ("matmul-float64", {"workload": "matmul", "params": {**mm, "dtype": "float64"}}),
        ("dot-float32", {"workload": "dot", "params": {"n": s["dot"], "dtype": "float32"}}),
        ("mandelbrot-float32", {"workload": "mandelbrot", "params": {**mb, "dtype": "float32"}}),
        ("mandelbrot-float64", {"workload": "mandelbrot", "params": {**mb, "dtype": "float64"}}),
    ]
    if backend == "cuda":
        out[1:1] = [
            ("matmul-tf32", {"workload": "matmul", "params": {**mm, "precision": "tf32"}}),
            ("matmul-float32-distributed", {"workload": "matmul", "params": {**mm, "operands": "distributed"}}),
        ]
    return out


def job_files(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The jobs of ``--job`` files: (name, job document), named as ``mgpu submit`` names them.

    Raises
    ------
    BenchInputError
        A file that is missing or not a YAML mapping, naming ``--job`` and the file.
    """
    out = []
    for path in map(Path, paths):
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise BenchInputError(f"--job: cannot read {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(doc, dict):
            raise BenchInputError(f"--job: {str(path)!r} holds no job (a YAML mapping with workload: and params:)")
        name = str(doc.pop("name", None) or path.stem)
        out.append((name, doc))
    return out


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body)."""
    backend, sizes, counts = resolve(opts)
    todo = jobs(sizes, backend) + job_files(opts.extra.get("jobs") or [])
    if opts.extra.get("cached_ceilings"):
        runs = run_jobs(opts, todo, backend, counts)
    else:
        with tempfile.TemporaryDirectory(prefix="mgpu-ceilings-") as cache, dask.config.set({"mgpu.cache-dir": cache}):
            runs = run_jobs(opts, todo, backend, counts)
    return {"backend": backend, "sizes": sizes, "device_counts": counts}, {"runs": runs, "summary": summarize(runs)}
