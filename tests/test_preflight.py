"""Every input and every path mgpu writes is checked before anything starts, by one preflight
that ``submit`` and ``submit --dry-run`` share: exit 2, one message naming the key or path,
nothing started and nothing written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import invoke, write_job

import mgpu.client.run
from mgpu.errors import JobInputError
from mgpu.paths import OutputClaims, claim_path


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if the client side tries to start or join a cluster."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cluster was started for a job that should have been refused")

    monkeypatch.setattr(mgpu.client.run, "open_cluster", refuse)


def _refused(res, *needles: str) -> str:
    assert "Traceback" not in res.output, res.output
    assert res.code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("mgpu: error:")]
    assert len(errors) == 1, res.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _dot(**cluster: Any) -> dict[str, Any]:
    return {"workload": "dot", "params": {"n": 1000}, "cluster": {"dashboard": None, **cluster}}


def _matmul_files(t: Path, output: str | None = None) -> dict[str, Any]:
    np.save(t / "a.npy", np.ones((8, 8), "float32"))
    np.save(t / "b.npy", np.ones((8, 8), "float32"))
    return {"workload": "matmul", "params": {"input": {"a": str(t / "a.npy"), "b": str(t / "b.npy")}, "output": output}}


def _fifo(t: Path) -> Path:
    os.mkfifo(t / "fifo")
    return t / "fifo"


# (id, job file: a doc or the file's bytes, extra args, needles of the one message)
CASES = [
    ("not-utf8", b"workload: dot\nparams: {n: 10}  # caf\xe9\n", [], ["not UTF-8", "line 2"]),
    ("utf16", "workload: dot\nparams: {n: 10}\n".encode("utf-16"), [], ["UTF-16", "save it as UTF-8"]),
    ("binary", b"\x7fELF\x02\x01\x00\x00workload", [], ["binary"]),
    ("misspelled-top-key", {"workload": "dot", "parms": {"n": 10}}, [], ["parms: unknown key", "params"]),
    ("bool-for-int", {"workload": "dot", "params": {"n": True}}, [], ["params.n:", "integer", "true"]),
    ("bool-tile-size", {"workload": "dot", "params": {"n": 100}, "tiling": {"n": True}}, [], ["tiling.n:"]),
    ("seed-past-64-bits", {"workload": "dot", "params": {"n": 10, "seed": 2**64}}, [], ["params.seed:"]),
    ("cpu-workers-past-cores", _dot(backend="cpu", devices=4096), [], ["cluster.devices:", "CPU core"]),
    ("cpu-worker-id-past-cores", _dot(backend="cpu", devices=[4096]), [], ["cluster.devices:", "ids 0-"]),
    ("budget-past-memory", _dot(backend="cpu", memory_limit="1PB"), [], ["cluster.memory_limit:", "has"]),
    ("json-is-a-directory", _dot(backend="cpu"), ["--json", "{t}"], ["--json:", "is a directory"]),
    ("json-folder-missing", _dot(backend="cpu"), ["--json", "{t}/no/r.json"], ["--json:", "does not exist"]),
    ("json-where-no-file-can-be-made", _dot(backend="cpu"), ["--json", "/proc/r.json"], ["--json:", "cannot write"]),
    ("json-is-the-job-file", _dot(backend="cpu"), ["--json", "{t}/job.yaml"], ["--json:", "job file"]),
    (
        "output-is-a-directory",
        lambda t: _matmul_files(t, str(t / "d.npy")),
        ["--force"],
        ["params.output:", "directory"],
    ),
    (
        "output-is-an-input",
        lambda t: _matmul_files(t, str(t / "a.npy")),
        ["--force"],
        ["params.output:", "input (params.input.a)"],
    ),
    ("json-is-an-input", lambda t: _matmul_files(t), ["--json", "{t}/a.npy"], ["--json:", "params.input.a"]),
    (
        "input-is-a-directory",
        lambda t: {**_matmul_files(t), "params": {"input": {"a": str(t), "b": str(t)}}},
        [],
        ["is a directory"],
    ),
    (
        "input-is-a-fifo",
        lambda t: {**_matmul_files(t), "params": {"input": {"a": str(_fifo(t)), "b": str(t / "b.npy")}}},
        [],
        ["params.input.a:", "not a regular file"],
    ),
    (
        "input-is-text",
        lambda t: (
            (t / "t.npy").write_text("1 2 3\n")
            and {**_matmul_files(t), "params": {"input": {"a": str(t / "t.npy"), "b": str(t / "b.npy")}}}
        ),
        [],
        ["params.input.a:", "not an .npy file"],
    ),
]


@pytest.mark.parametrize("dry", [False, True], ids=["submit", "dry-run"])
@pytest.mark.parametrize("build,extra,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_anything_starts(tmp_path, no_cluster, no_gpu, build, extra, needles, dry):
    (tmp_path / "d.npy").mkdir()
    doc = build(tmp_path) if callable(build) else build
    job = tmp_path / "job.yaml"
    if isinstance(doc, bytes):
        job.write_bytes(doc)
    else:
        write_job(job, doc)
    before = sorted(os.listdir(tmp_path))
    args = [a.format(t=tmp_path) for a in extra]
    res = invoke("submit", job, *args, *(["--dry-run"] if dry else []))
    _refused(res, *needles)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no claim left


@pytest.mark.parametrize("flag", ["7,", "0,1"])
def test_gpu_ids_without_a_gpu_are_refused_not_run_on_cpu_workers(tmp_path, no_cluster, no_gpu, flag):
    job = write_job(tmp_path / "job.yaml", _dot())
    message = _refused(invoke("submit", job, "--devices", flag), "cluster.devices:", "no GPU is visible")
    assert "count of CPU workers" in message


def test_an_output_claimed_by_a_running_job_is_refused_naming_it(tmp_path, no_cluster):
    out = tmp_path / "c.npy"
    job = write_job(
        tmp_path / "job.yaml", {"workload": "matmul", "params": {"m": 8, "n": 8, "k": 8, "output": str(out)}}
    )
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Path(claim_path(str(out))).write_text(
            json.dumps({"pid": holder.pid, "host": socket.gethostname(), "job": "first"})
        )
        _refused(invoke("submit", job, "--dry-run"), "params.output:", "job 'first'", f"pid {holder.pid}")
        _refused(invoke("submit", job), "params.output:", "job 'first'", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()


def test_a_claim_whose_pid_another_process_took_since_is_taken_over(tmp_path):
    out = str(tmp_path / "c.npy")
    # This process's pid, but started before it: the claim's process died and its pid was reused.
    me = psutil.Process()
    Path(claim_path(out)).write_text(
        json.dumps({"pid": me.pid, "started": me.create_time() - 60, "host": socket.gethostname(), "job": "gone"})
    )
    with OutputClaims().held([(out, "params.output", "mine")]):
        assert json.loads(Path(claim_path(out)).read_text())["job"] == "mine"


def test_a_claim_left_by_a_dead_process_is_taken_over(tmp_path):
    out = str(tmp_path / "c.npy")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    Path(claim_path(out)).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "job": "gone"}))
    claims = OutputClaims()
    with claims.held([(out, "params.output", "mine")]):
        record = json.loads(Path(claim_path(out)).read_text())
        assert record["pid"] == os.getpid() and record["job"] == "mine"
        # A second claim of the same output, from this live process, is refused.
        with pytest.raises(JobInputError, match="job 'mine'"):
            OutputClaims().take([(out, "params.output", "other")])
    assert not Path(claim_path(out)).exists()  # released at the end


def test_a_write_that_fails_later_is_one_line_naming_the_path(tmp_path):
    from mgpu.errors import JobFailed
    from mgpu.paths import write_text

    gone = tmp_path / "gone"
    gone.mkdir()
    target = gone / "r.json"
    gone.rmdir()  # removed between the check and the write
    with pytest.raises(JobFailed) as e:
        write_text(target, "{}", key="--json")
    assert str(e.value) == f"--json: could not write {target}: No such file or directory"


@pytest.mark.parametrize(
    "bound,warned",
    [("127.0.0.1:8787", False), ("localhost:8787", False), ("0.0.0.0:8787", True), ("10.1.2.3:80", True)],
)
def test_the_dashboard_is_told_where_it_listens_and_warned_beyond_localhost(capsys, bound, warned):
    from rich.console import Console

    from mgpu.cli import _tell_dashboard

    class Info:
        dashboard_link = "http://127.0.0.1:8787/status"
        dashboard_address = (bound, f"http://{bound}/status")

    _tell_dashboard(Console(file=sys.stdout, width=200), Info())
    out, err = capsys.readouterr()
    assert f"listening on {bound}" in out
    assert ("anyone who can reach this host can see it" in err) is warned


@pytest.mark.parametrize("out", ["{t}/job.yaml/sub", "/proc/sweep"])
def test_a_sweep_folder_that_cannot_be_made_is_refused_before_any_run(tmp_path, no_cluster, out):
    job = write_job(tmp_path / "job.yaml", _dot(backend="cpu"))
    before = sorted(os.listdir(tmp_path))
    _refused(invoke("scale", job, "--devices", "1", "--out", out.format(t=tmp_path)), "--out:")
    assert sorted(os.listdir(tmp_path)) == before
