"""A submit to the cluster ``mgpu cluster up`` started is handed to the cluster's submit
server: the command's own process imports none of the client side, and the command runs
in a process forked ahead as it would have in its own (its folder, environment, streams,
exit code and signals)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_for, write_job

from mgpu import handover, submit_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """mgpu's cache folder, where a cluster of two CPU workers is recorded up."""
    folder = tmp_path_factory.mktemp("cache")
    up = _mgpu(folder, ["cluster", "up", "--backend", "cpu", "--devices", "2", "--no-dashboard"], cwd=ROOT)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield folder
    finally:
        down = _mgpu(folder, ["cluster", "down"], cwd=ROOT)
        assert down.returncode == 0, down.stderr


def _env(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "DASK_MGPU__CACHE_DIR": str(cache), **extra}


def _mgpu(cache: Path, args: list[Any], cwd: Path, **extra: Any) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-X", "importtime", "-m", "mgpu", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=_env(cache, **extra), capture_output=True, text=True, timeout=120)


def _imported_by_the_command(stderr: str) -> set[str]:
    """The modules the command's own process imported (``-X importtime``'s lines)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _server(cache: Path) -> psutil.Process:
    record = json.loads((cache / "cluster.json").read_text())
    group = psutil.Process(record["pid"]).children()
    (server,) = [p for p in group if "mgpu.submit_server" in p.cmdline()]
    return server


def _forked_ahead(cache: Path) -> psutil.Process:
    """The process the submit server forked ahead for the next command (its only child
    while no command runs)."""
    server = _server(cache)
    (ahead,) = wait_for(lambda: [p for p in server.children() if p.status() != psutil.STATUS_ZOMBIE] or None, 30)
    return ahead


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_STOPPED
    except (psutil.Error, OSError):  # ended meanwhile
        return False


def _private_share(proc: psutil.Process) -> float:
    """The share of ``proc``'s resident memory that is its own (written since its fork)."""
    fields = dict(line.split(":") for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines()[1:])
    kib = {k: int(v.split()[0]) for k, v in fields.items()}
    return kib["Private_Dirty"] / kib["Rss"]


def test_a_submit_runs_in_the_server_from_its_own_folder_with_its_streams(cache, tmp_path):
    write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 100_003}})
    done = _mgpu(cache, ["submit", "dot.yaml", "--json", "-"], cwd=tmp_path)  # a path relative to its folder
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # the JSON reached this process's stdout, the people's lines its stderr
    assert result["status"] == "ok" and result["verify"]["passed"]
    assert "joining the running cluster" in done.stderr
    imported = _imported_by_the_command(done.stderr)
    assert "mgpu.handover" in imported
    assert not imported & {"dask", "distributed", "numpy", "pydantic", "mgpu.cli"}, sorted(imported)


def test_the_submit_takes_its_own_environment_and_exit_code(cache, tmp_path):
    job = write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 1000}})
    # The server was started without it: the command's environment is read again.
    bad = _mgpu(cache, ["submit", job, "-q"], cwd=tmp_path, DASK_MGPU__CEILINGS__SAMPLES="many")
    assert bad.returncode == 2, bad.stderr
    said = [line for line in bad.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == 1 and said[0].startswith("mgpu: error: mgpu.ceilings.samples"), said
    assert "distributed" not in _imported_by_the_command(bad.stderr)


def test_the_submit_connects_with_its_own_dask_configuration(cache, tmp_path):
    job = write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 1000}})
    # A connection no one could make in time: the process forked ahead connected without it.
    env = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "0.00001"}
    handed = _mgpu(cache, ["submit", job, "-q"], cwd=tmp_path, **env)
    elsewhere = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(tmp_path)])  # another module path
    itself = _mgpu(cache, ["submit", job, "-q"], cwd=tmp_path, PYTHONPATH=elsewhere, **env)
    assert "distributed" not in _imported_by_the_command(handed.stderr)
    assert "distributed" in _imported_by_the_command(itself.stderr)
    for done in (handed, itself):
        said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
        assert done.returncode == 2 and "could not connect" in said[-1], done.stderr


def test_the_same_environment_reads_as_the_same_configuration(tmp_path):
    # What the process forked ahead connected with, against what a submit in the same
    # environment reads again: the same, so the submit takes the connection made ahead.
    probe = (
        "import copy, dask.config\nfrom mgpu import submit_server\nsubmit_server.prepare()\n"
        "before = copy.deepcopy(dask.config.config)\ndask.config.refresh()\n"
        "print(submit_server._spelled(before) == submit_server._spelled(dask.config.config))"
    )
    env = {**os.environ, "DASK_MGPU__CACHE_DIR": str(tmp_path), "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "9s"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr


def test_a_command_the_server_would_run_otherwise_runs_itself(cache, tmp_path):
    write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 1000}})
    extra = tmp_path / "lib"
    extra.mkdir()
    path = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(extra)])
    done = _mgpu(cache, ["submit", "dot.yaml", "--json", "r.json"], cwd=tmp_path, PYTHONPATH=path)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "ok"
    assert "distributed" in _imported_by_the_command(done.stderr)  # its own process ran it, on the cluster
    assert "joining the running cluster" in done.stdout


def test_ctrl_c_reaches_the_submit_in_the_server(cache, tmp_path):
    job = write_job(tmp_path / "m.yaml", {"workload": "mandelbrot", "params": {"width": 4096, "height": 4096}})
    said = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "mgpu", "submit", str(job), "--json", str(tmp_path / "r.json")]
    command = _forked_ahead(cache)  # which runs the next command
    with open(said, "w") as err, subprocess.Popen(cmd, env=_env(cache), stdout=err, stderr=err) as proc:
        wait_for(lambda: "plan:" in said.read_text() or proc.poll() is not None, 60, "the job's plan")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, said.read_text()
    assert "interrupted (SIGINT); the job's tasks were cancelled" in said.read_text()
    assert not command.is_running() and not list(tmp_path.glob("r.json*"))


def test_ctrl_z_stops_the_submit_in_the_server_and_fg_continues_it(cache, tmp_path):
    job = write_job(tmp_path / "m.yaml", {"workload": "mandelbrot", "params": {"width": 2048, "height": 2048}})
    said = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "mgpu", "submit", str(job), "--json", str(tmp_path / "r.json")]
    command = _forked_ahead(cache)
    # The caller in a process group of its own, as a shell runs a job: where the tests' own
    # group is orphaned (their parent left), the kernel discards a Ctrl-Z's stop there.
    own_group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(said, "w") as err, subprocess.Popen(cmd, env=_env(cache), stdout=err, stderr=err, **own_group) as proc:
        caller = psutil.Process(proc.pid)
        try:
            wait_for(lambda: "plan:" in said.read_text() or proc.poll() is not None, 60, "the job's plan")
            proc.send_signal(signal.SIGTSTP)
            wait_for(lambda: _stopped(command) and _stopped(caller), 30, "the command and its caller stopped")
            proc.send_signal(signal.SIGCONT)
            wait_for(lambda: not _stopped(command), 30, "the command continued")
            assert proc.wait(timeout=120) == 0, said.read_text()
        finally:  # a stopped command or caller would hold the test up
            for stopped in (command, caller):
                with contextlib.suppress(psutil.Error):
                    stopped.resume()
                    stopped.kill()
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "ok"


def test_a_submit_whose_caller_was_killed_ends(cache, tmp_path):
    job = write_job(tmp_path / "m.yaml", {"workload": "mandelbrot", "params": {"width": 4096, "height": 4096}})
    said = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "mgpu", "submit", str(job), "--json", str(tmp_path / "r.json")]
    command = _forked_ahead(cache)
    # It copied the server's memory while it waited, not page by page under the command.
    wait_for(lambda: _private_share(command) > 0.5, 30, "its own copy of the server's memory")
    with open(said, "w") as err, subprocess.Popen(cmd, env=_env(cache), stdout=err, stderr=err) as proc:
        wait_for(lambda: "plan:" in said.read_text() or proc.poll() is not None, 60, "the job's plan")
        # None is forked for the next command while this one runs.
        assert [p.pid for p in _server(cache).children()] == [command.pid]
        proc.kill()
    _, alive = psutil.wait_procs([command], timeout=30)
    assert alive == [] and not list(tmp_path.glob("r.json*"))


@pytest.mark.parametrize(
    "change,why",
    [
        ({"executable": "/usr/bin/python0"}, "another interpreter"),
        ({"package": "/elsewhere/mgpu/handover.py"}, "another mgpu"),
        ({"path": [os.getcwd(), "/elsewhere", *sys.path[1:]]}, "another module path"),
        ({"path": ["/any/folder", *sys.path[1:]]}, None),  # the first entry is the command's folder
    ],
)
def test_the_server_runs_only_a_command_that_would_run_the_same(change, why):
    asked = {**handover.request(), **change}
    said = submit_server.compatible(asked, handover.fingerprint())
    assert (said is None) if why is None else said.startswith(why)


def test_a_command_after_mgpu_s_files_changed_runs_itself(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/a.py"):
        (package / name).write_text("")
    imported = handover.fingerprint(str(package))
    asked = {**handover.request(), "fingerprint": imported}
    assert submit_server.compatible(asked, imported) is None
    edited = package / "sub" / "a.py"
    os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns + 1))  # a file edited
    after_edit = handover.fingerprint(str(package))
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "a.cpython-311.pyc").write_text("")  # compiled: no change of mgpu's
    assert handover.fingerprint(str(package)) == after_edit
    (package / "b.py").write_text("")  # a file added
    for now in (after_edit, handover.fingerprint(str(package))):
        assert now != imported
        said = submit_server.compatible({**asked, "fingerprint": now}, imported)
        assert said == "mgpu's files changed since the server imported them"
    assert handover.fingerprint(str(package))[0] == after_edit[0] + 1


@pytest.mark.parametrize(
    "argv",
    [
        ["cluster", "status"],
        ["submit", "job.yaml", "--scheduler", "tcp://x:1"],
        ["submit", "job.yaml", "--scheduler-file=s.json"],
        ["submit", "job.yaml", "--own-cluster"],
        ["submit", "job.yaml", "--dry-run"],
    ],
)
def test_only_a_submit_that_would_join_the_cluster_up_is_handed_over(monkeypatch, tmp_path, argv):
    monkeypatch.setattr("mgpu.lifetime.is_command", lambda: True)
    monkeypatch.setattr(sys, "argv", ["mgpu", *argv])
    monkeypatch.setattr(handover, "recorded", lambda: pytest.fail("looked for the cluster"))
    handover.hand_over_command()


def test_a_ctrl_z_while_the_submit_is_handed_over_waits_for_the_handlers(monkeypatch):
    # Until _follow passes Ctrl-Z on, it would stop the caller and leave the command running.
    monkeypatch.setattr("mgpu.lifetime.is_command", lambda: True)
    monkeypatch.setattr(sys, "argv", ["mgpu", "submit", "job.yaml"])
    monkeypatch.setattr(handover, "recorded", lambda: {"submit": "mgpu-test-none"})
    during: list[set[int]] = []

    def connect(name: str) -> None:
        during.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return None  # no server: the command runs itself

    monkeypatch.setattr(handover, "_connect", connect)
    handover.hand_over_command()
    assert signal.SIGTSTP in during[0]
    assert signal.SIGTSTP not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # and after, as before
