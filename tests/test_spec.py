"""Bad input through the real CLI: exit 2, one message naming the key or flag and what is
allowed, no traceback, nothing started and nothing written. And overrides that work."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import invoke, write_job

import mgpu.client.run


def _matmul(tmp: Path, **params: Any) -> dict[str, Any]:
    return {
        "workload": "matmul",
        "params": {"m": 8, "n": 8, "k": 8, "output": str(tmp / "c.npy"), **params},
        "cluster": {"backend": "cpu", "devices": 2, "dashboard": None},
    }


def _with(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with ``dotted`` set (``None`` as value: the key removed)."""
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return doc


def _npy_files(tmp: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    files = {
        "a": (4, 5, "float32"),
        "b": (5, 3, "float32"),
        "b64": (5, 3, "float64"),
        "b6": (6, 3, "float32"),
        "a1": (5, None, "float32"),
        "x": (7, None, "float64"),
        "y": (8, None, "float64"),
    }
    out = {}
    for name, (r, c, dt) in files.items():
        shape = (r,) if c is None else (r, c)
        np.save(tmp / f"{name}.npy", rng.standard_normal(shape).astype(dt))
        out[name] = tmp / f"{name}.npy"
    np.save(tmp / "ai.npy", np.arange(20, dtype=np.int32).reshape(4, 5))
    out["ai"] = tmp / "ai.npy"
    return out


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if the client side tries to start or join a cluster."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cluster was started for a job that should have been refused")

    monkeypatch.setattr(mgpu.client.run, "open_cluster", refuse)


def _assert_refused(res, *needles: str) -> str:
    """Exit 2, exactly one error line on stderr that holds every needle, nothing on stdout."""
    assert "Traceback" not in res.output, res.output
    assert res.code == 2, res.output
    assert res.stdout == ""
    errors = [line for line in res.stderr.splitlines() if line.startswith(("mgpu: error:", "Error:"))]
    assert len(errors) == 1, res.stderr
    # Nothing else but click's usage lines.
    others = [
        line
        for line in res.stderr.splitlines()
        if line.strip() and line not in errors and not line.startswith(("Usage:", "Try "))
    ]
    assert others == [], res.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# Each case: (id, how to build the job file, extra CLI args, substrings the message must hold).
# The builder gets the tmp folder and the .npy inputs, and returns a doc (dict) or raw text.
CASES = [
    ("malformed-yaml", lambda t, f: "workload: [matmul\nparams: {m: 8\n", [], ["is not valid YAML", "line"]),
    ("not-a-mapping", lambda t, f: "- workload\n- matmul\n", [], ["must be a mapping", "workload:"]),
    ("scalar-file", lambda t, f: "just a string\n", [], ["must be a mapping"]),
    (
        "unknown-top-level-key",
        lambda t, f: _with(_matmul(t), "colour", "blue"),
        [],
        ["colour: unknown key", "allowed:", "cluster", "params", "tiling", "workload"],
    ),
    (
        "unknown-cluster-key",
        lambda t, f: _with(_matmul(t), "cluster.gpus", 2),
        [],
        ["cluster.gpus: unknown key", "allowed:", "allocator", "backend", "memory_limit"],
    ),
    (
        "unknown-params-key",
        lambda t, f: _with(_matmul(t), "params.size", 2),
        [],
        ["params.size: unknown key", "allowed:", "dtype", "k", "m", "n"],
    ),
    ("params-not-mapping", lambda t, f: _with(_matmul(t), "params", [1, 2]), [], ["params:", "mapping"]),
    (
        "unknown-workload",
        lambda t, f: _with(_matmul(t), "workload", "fft"),
        [],
        ["workload:", "'fft'", "dot, mandelbrot, matmul"],
    ),
    (
        "missing-workload",
        lambda t, f: _with(_matmul(t), "workload", None),
        [],
        ["workload:", "missing", "dot, mandelbrot, matmul"],
    ),
    (
        "wrong-enum",
        lambda t, f: _with(_matmul(t), "cluster.allocator", "foo"),
        [],
        ["cluster.allocator:", "'pool'", "'async'", "'managed'", "'default'"],
    ),
    (
        "wrong-enum-backend",
        lambda t, f: _with(_matmul(t), "cluster.backend", "rocm"),
        [],
        ["cluster.backend:", "'auto'", "'cuda'", "'cpu'"],
    ),
    (
        "bad-size-string",
        lambda t, f: _with(_matmul(t), "cluster.memory_limit", "lots"),
        [],
        ["cluster.memory_limit:", "'lots'", "40GB"],
    ),
    (
        "fraction-above-1",
        lambda t, f: _with(_matmul(t), "cluster.memory_limit", 1.5),
        [],
        ["cluster.memory_limit:", "(0, 1]", "1.5"],
    ),
    (
        "zero-bytes",
        lambda t, f: _with(_matmul(t), "cluster.memory_limit", 0),
        [],
        ["cluster.memory_limit:", "positive"],
    ),
    (
        "negative-bytes",
        lambda t, f: _with(_matmul(t), "cluster.memory_limit", -4096),
        [],
        ["cluster.memory_limit:", "positive"],
    ),
    ("zero-m", lambda t, f: _with(_matmul(t), "params.m", 0), [], ["params.m:", "greater than 0"]),
    ("negative-k", lambda t, f: _with(_matmul(t), "params.k", -3), [], ["params.k:", "greater than 0"]),
    ("m-not-a-number", lambda t, f: _with(_matmul(t), "params.m", "big"), [], ["params.m:", "integer"]),
    ("missing-m-for-random", lambda t, f: _with(_matmul(t), "params.m", None), [], ["params.m:", "required", "random"]),
    ("zero-devices", lambda t, f: _with(_matmul(t), "cluster.devices", 0), [], ["cluster.devices:", "at least 1"]),
    (
        "devices-true",
        lambda t, f: _with(_matmul(t), "cluster.devices", True),
        [],
        ["cluster.devices:", "'all', a count or a list of device ids", "got true"],
    ),
    (
        "memory-limit-true",
        lambda t, f: _with(_matmul(t), "cluster.memory_limit", True),
        [],
        ["cluster.memory_limit:", "40GB", "got true"],
    ),
    ("devices-flag-zero", lambda t, f: _matmul(t), ["--devices", "0"], ["cluster.devices:", "at least 1"]),
    ("zero-tile", lambda t, f: _with(_matmul(t), "tiling", {"m": 0}), [], ["tiling:", "at least 1"]),
    (
        "tiling-unknown-axis",
        lambda t, f: _with(_matmul(t), "tiling", {"m": 4, "q": 2}),
        [],
        ["tiling:", "'q'", "allowed: m, n, k"],
    ),
    (
        "dot-tiling-unknown-axis",
        lambda t, f: {"workload": "dot", "params": {"n": 10}, "tiling": {"m": 3}},
        [],
        ["tiling:", "'m'", "allowed: n"],
    ),
    ("set-malformed", lambda t, f: _matmul(t), ["--set", "params.m"], ["--set", "KEY=VALUE"]),
    ("set-empty-key", lambda t, f: _matmul(t), ["--set", "=4"], ["--set", "KEY=VALUE"]),
    ("set-into-a-value", lambda t, f: _matmul(t), ["--set", "params.m.x=4"], ["--set", "'m'", "not a section"]),
    ("devices-flag-bad", lambda t, f: _matmul(t), ["--devices", "zero"], ["--devices", "all", "0,1"]),
    ("devices-flag-list-bad", lambda t, f: _matmul(t), ["--devices", "0,x"], ["--devices", "0,1"]),
    ("devices-flag-repeat", lambda t, f: _matmul(t), ["--devices", "0,0"], ["cluster.devices:", "repeat"]),
    ("backend-flag-bad", lambda t, f: _matmul(t), ["--backend", "rocm"], ["--backend", "'cuda'", "'cpu'"]),
    (
        "input-npy-missing",
        lambda t, f: _with(
            _matmul(t, m=None, n=None, k=None), "params.input", {"a": str(t / "nope.npy"), "b": str(f["b"])}
        ),
        [],
        ["params.input", "nope.npy", "does not exist"],
    ),
    (
        "input-wrong-ndim",
        lambda t, f: _with(_matmul(t, m=None, n=None, k=None), "params.input", {"a": str(f["a1"]), "b": str(f["b"])}),
        [],
        ["params.input.a:", "2-D", "(5,)"],
    ),
    (
        "input-wrong-dtype",
        lambda t, f: _with(_matmul(t, m=None, n=None, k=None), "params.input", {"a": str(f["ai"]), "b": str(f["b"])}),
        [],
        ["params.input", "int32", "float16, float32, float64"],
    ),
    (
        "input-dtype-mismatch",
        lambda t, f: _with(_matmul(t, m=None, n=None, k=None), "params.input", {"a": str(f["a"]), "b": str(f["b64"])}),
        [],
        ["params.input:", "float32", "float64", "must match"],
    ),
    (
        "input-shape-mismatch",
        lambda t, f: _with(_matmul(t, m=None, n=None, k=None), "params.input", {"a": str(f["a"]), "b": str(f["b6"])}),
        [],
        ["params.input:", "(4, 5)", "(6, 3)"],
    ),
    (
        "input-unknown-operand",
        lambda t, f: _with(
            _matmul(t, m=None, n=None, k=None), "params.input", {"a": str(f["a"]), "b": str(f["b"]), "c": str(f["b"])}
        ),
        [],
        ["params.input:", "'c'", "allowed: a, b"],
    ),
    (
        "input-not-a-file",
        lambda t, f: _with(_matmul(t, m=None, n=None, k=None), "params.input", "zeros"),
        [],
        ["params.input:", "random"],
    ),
    (
        "m-disagrees-with-file",
        lambda t, f: _with(_matmul(t, m=7, n=None, k=None), "params.input", {"a": str(f["a"]), "b": str(f["b"])}),
        [],
        ["params.m:", "7", "disagrees", "(4)"],
    ),
    (
        "dot-files-mismatch",
        lambda t, f: {"workload": "dot", "params": {"input": {"x": str(f["x"]), "y": str(f["y"])}}},
        [],
        ["params.input:", "(7,)", "(8,)"],
    ),
    (
        "dot-n-disagrees",
        lambda t, f: {"workload": "dot", "params": {"n": 3, "input": {"x": str(f["x"]), "y": str(f["x"])}}},
        [],
        ["params.n:", "disagrees"],
    ),
    ("dot-zero-n", lambda t, f: {"workload": "dot", "params": {"n": 0}}, [], ["params.n:", "greater than 0"]),
    (
        "output-folder-missing",
        lambda t, f: _with(_matmul(t), "params.output", str(t / "no" / "c.npy")),
        [],
        ["params.output:", "does not exist"],
    ),
    (
        "output-wrong-suffix",
        lambda t, f: _with(_matmul(t), "params.output", str(t / "c.txt")),
        [],
        ["params.output:", ".npy"],
    ),
    (
        "json-folder-missing",
        lambda t, f: _matmul(t),
        ["--json", "/nonexistent-folder/out.json"],
        ["--json", "does not exist"],
    ),
    (
        "tf32-with-float64",
        lambda t, f: _matmul(t, dtype="float64", precision="tf32"),
        [],
        ["params.precision:", "tf32", "float32"],
    ),
    (
        "mandelbrot-xmin-above-xmax",
        lambda t, f: {"workload": "mandelbrot", "params": {"width": 8, "height": 8, "xmin": 1.0, "xmax": -1.0}},
        [],
        ["params.xmin:", "xmax"],
    ),
    (
        "mandelbrot-xmin-equals-xmax",
        lambda t, f: {"workload": "mandelbrot", "params": {"width": 8, "height": 8, "xmin": 0.5, "xmax": 0.5}},
        [],
        ["params.xmin:", "xmax"],
    ),
    (
        "mandelbrot-png-suffix",
        lambda t, f: {
            "workload": "mandelbrot",
            "params": {"width": 8, "height": 8, "output": {"png": str(t / "m.jpg")}},
        },
        [],
        ["params.output.png:", ".png"],
    ),
    (
        "mandelbrot-dtype",
        lambda t, f: {"workload": "mandelbrot", "params": {"width": 8, "height": 8, "dtype": "float16"}},
        [],
        ["params.dtype:", "'float32'", "'float64'"],
    ),
]


@pytest.mark.parametrize("build,extra,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_message(tmp_path, no_cluster, build, extra, needles):
    files = _npy_files(tmp_path)
    doc = build(tmp_path, files)
    job = tmp_path / "job.yaml"
    if isinstance(doc, str):
        job.write_text(doc)
    else:
        write_job(job, doc)
    before = sorted(os.listdir(tmp_path))
    out_json = tmp_path / "out.json"
    args = ["submit", job, *extra]
    if "--json" not in extra:
        args += ["--json", out_json]
    res = invoke(*args)
    _assert_refused(res, *needles)
    assert sorted(os.listdir(tmp_path)) == before  # no output, no JSON, no temporary file


def test_missing_job_file(tmp_path, no_cluster):
    res = invoke("submit", tmp_path / "absent.yaml", "--json", tmp_path / "out.json")
    _assert_refused(res, "absent.yaml", "does not exist")
    assert os.listdir(tmp_path) == []


def test_cuda_without_a_gpu_names_cluster_backend(tmp_path, no_cluster, no_gpu):
    job = write_job(tmp_path / "job.yaml", _matmul(tmp_path))
    res = invoke("submit", job, "--backend", "cuda")
    _assert_refused(res, "cluster.backend:", "cuda", "no GPU", "backend: cpu or auto")
    # The same through the job file.
    job = write_job(tmp_path / "job.yaml", _with(_matmul(tmp_path), "cluster.backend", "cuda"))
    _assert_refused(invoke("submit", job), "cluster.backend:")


def test_existing_output_is_refused_and_left_untouched(tmp_path, no_cluster):
    out = tmp_path / "c.npy"
    original = np.arange(6.0).reshape(2, 3)
    np.save(out, original)
    before = out.read_bytes()
    mtime = out.stat().st_mtime_ns
    job = write_job(tmp_path / "job.yaml", _matmul(tmp_path))
    res = invoke("submit", job, "--json", tmp_path / "out.json")
    _assert_refused(res, "params.output:", "already exists", "--force")
    assert out.read_bytes() == before and out.stat().st_mtime_ns == mtime
    assert sorted(os.listdir(tmp_path)) == ["c.npy", "job.yaml"]


def test_mandelbrot_existing_png_is_refused(tmp_path, no_cluster):
    png = tmp_path / "m.png"
    png.write_bytes(b"not really a png")
    job = write_job(
        tmp_path / "job.yaml",
        {"workload": "mandelbrot", "params": {"width": 8, "height": 8, "output": {"png": str(png)}}},
    )
    _assert_refused(invoke("submit", job), "params.output.png:", "already exists", "--force")
    assert png.read_bytes() == b"not really a png"


# -- these reach the shared cluster ------------------------------------------------------------


def test_existing_output_is_replaced_with_force(tmp_path, scheduler):
    out = tmp_path / "c.npy"
    np.save(out, np.zeros((2, 2)))
    job = write_job(tmp_path / "job.yaml", _matmul(tmp_path, m=9, n=5, k=3))
    res = invoke("submit", job, "--scheduler", scheduler, "--force", "-q", "--json", tmp_path / "out.json")
    assert res.code == 0, res.output
    c = np.load(out)
    assert c.shape == (9, 5) and c.dtype == np.float32
    assert json.loads((tmp_path / "out.json").read_text())["outputs"] == [str(out)]
    assert [p for p in os.listdir(tmp_path) if p.endswith(".partial")] == []


def test_set_override_changes_the_job(tmp_path, scheduler):
    job = write_job(tmp_path / "job.yaml", _matmul(tmp_path))
    res = invoke(
        "submit",
        job,
        "--scheduler",
        scheduler,
        "-q",
        "--json",
        tmp_path / "out.json",
        "--set",
        "params.m=64",
        "--set",
        "params.seed=3",
        "--set",
        "verify=false",
    )
    assert res.code == 0, res.output
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["job"]["params"]["m"] == 64 and data["job"]["params"]["seed"] == 3
    assert data["job"]["verify"] is False and data["verify"]["passed"] is None
    assert data["job"]["cluster"]["scheduler"] == scheduler  # --scheduler is an override too
    assert np.load(tmp_path / "c.npy").shape == (64, 8)


@pytest.mark.parametrize(
    "workload,params,limit",
    [
        ("matmul", {"m": 8, "n": 8, "k": 8}, "1000"),
        ("matmul", {"m": 4096, "n": 4096, "k": 4096}, "1MB"),  # a 256 x 256 x 256 tile needs more
        ("dot", {"n": 1000}, "10"),
    ],
)
def test_memory_limit_too_small_for_a_minimal_tile(tmp_path, scheduler, workload, params, limit):
    params = {**params, "output": str(tmp_path / "c.npy")} if workload == "matmul" else params
    job = write_job(tmp_path / "job.yaml", {"workload": workload, "params": params})
    res = invoke(
        "submit",
        job,
        "--scheduler",
        scheduler,
        "--json",
        tmp_path / "out.json",
        "--set",
        f"cluster.memory_limit={limit}",
    )
    assert "Traceback" not in res.output
    assert res.code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("mgpu: error:")]
    assert len(errors) == 1 and "cluster.memory_limit:" in errors[0], res.stderr
    assert "budget" in errors[0] or "cannot hold" in errors[0]
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]  # no output, no .partial, no JSON


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).resolve().parents[1].joinpath("jobs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_job_file_is_valid(path):
    from mgpu.spec import load_job

    job = load_job(path, [])
    assert job.name == path.stem
