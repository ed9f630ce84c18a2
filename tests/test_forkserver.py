"""A submit that starts its own cluster forks the workers from a server that imported
their libraries while the command started: the workers are the server's children, start
with the pre-spawn environment a nanny would give them, and run jobs as spawned ones do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import dask.config
import psutil
import pytest
from conftest import wait_for, write_job

import mgpu
from mgpu import forkserver

ROOT = Path(__file__).resolve().parents[1]


def _state() -> dict[str, Any]:
    return {
        "ppid": os.getppid(),
        "preimported": "mgpu.worker.preimport" in sys.modules,
        "env": {k: os.environ.get(k) for k in forkserver.PRE_SPAWN_ENVIRON},
    }


class _Watch(mgpu.Events):
    def __init__(self) -> None:
        self.workers: list[dict[str, Any]] = []

    def cluster_ready(self, info: Any) -> None:
        self.workers = list(info.client.run(_state).values())


@pytest.fixture
def server() -> Any:
    forkserver.start()
    try:
        yield forkserver._server()._forkserver_pid
    finally:
        forkserver.stop()


def test_workers_are_forked_from_the_server_with_the_pre_spawn_environment(tmp_path, server):
    job = write_job(
        tmp_path / "dot.yaml",
        {"workload": "dot", "params": {"n": 100_000}, "cluster": {"backend": "cpu", "devices": 2, "dashboard": None}},
    )
    watch = _Watch()
    result = mgpu.run(job, events=watch)
    assert result.status == "ok"
    assert [w["ppid"] for w in watch.workers] == [server, server]
    assert all(w["preimported"] for w in watch.workers)
    assert all(w["env"] == forkserver.PRE_SPAWN_ENVIRON for w in watch.workers)


def test_starting_the_server_leaves_this_process_environment_as_it_was(monkeypatch):
    for key in forkserver.PRE_SPAWN_ENVIRON:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    forkserver.start()
    try:
        assert forkserver.started()
        assert os.environ["OMP_NUM_THREADS"] == "3"
        assert not any(k in os.environ for k in forkserver.PRE_SPAWN_ENVIRON if k != "OMP_NUM_THREADS")
    finally:
        forkserver.stop()
    assert not forkserver.started()


def test_other_pre_spawn_settings_spawn_the_workers_as_usual(server):
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {"OMP_NUM_THREADS": 4}}):
        with forkserver.forking() as forks:
            assert not forks
            assert dask.config.get("distributed.worker.multiprocessing-method") == "spawn"
    with forkserver.forking() as forks:
        assert forks
        assert dask.config.get("distributed.worker.multiprocessing-method") == "forkserver"


def test_without_the_server_the_workers_are_spawned():
    assert not forkserver.started()
    with forkserver.forking() as forks:
        assert not forks


@pytest.mark.parametrize(
    ("argv", "starts"),
    [
        (["submit", "job.yaml"], True),
        (["submit", "--devices", "2", "job.yaml"], True),
        (["submit", "--scheduler", "tcp://h:8786", "job.yaml"], False),
        (["submit", "--scheduler-file=s.json", "job.yaml"], False),
        (["submit", "--dry-run", "job.yaml"], False),
        (["bench", "suite"], False),
        (["report", "r.json"], False),
        ([], False),
    ],
)
def test_the_command_starts_the_server_only_for_a_submit_that_may_start_a_cluster(monkeypatch, argv, starts):
    started: list[bool] = []
    monkeypatch.setattr("mgpu.lifetime.is_command", lambda: True)
    monkeypatch.setattr(forkserver, "start", lambda: started.append(True))
    assert forkserver.start_for_command(argv) is starts
    assert started == ([True] if starts else [])


@pytest.mark.parametrize(
    ("argv", "record", "starts"),
    [
        (["submit", "job.yaml"], "alive", False),  # it joins the cluster mgpu cluster up started
        (["submit", "--own-cluster", "job.yaml"], "alive", True),
        (["submit", "job.yaml"], "ended", True),  # a stale record: no cluster to join
        (["submit", "job.yaml"], "unreadable", True),
    ],
)
def test_a_submit_that_will_join_the_cluster_up_starts_no_server(monkeypatch, tmp_path, argv, record, starts):
    started: list[bool] = []
    monkeypatch.setattr("mgpu.lifetime.is_command", lambda: True)
    monkeypatch.setattr(forkserver, "start", lambda: started.append(True))
    monkeypatch.setenv("DASK_MGPU__CACHE_DIR", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    pid = {"alive": os.getpid(), "ended": ended.pid}.get(record)
    (tmp_path / "cluster.json").write_text(json.dumps({"pid": pid}) if pid else "{")
    assert forkserver.start_for_command(argv) is starts
    assert started == ([True] if starts else [])


def test_a_program_importing_mgpu_starts_no_server(monkeypatch):
    monkeypatch.setattr(forkserver, "start", lambda: pytest.fail("started a server"))
    assert not forkserver.start_for_command(["submit", "job.yaml"])


def test_a_submit_that_starts_its_cluster_forks_its_workers_and_leaves_no_process(tmp_path):
    job = write_job(
        tmp_path / "dot.yaml",
        {"workload": "dot", "params": {"n": 100_000}, "cluster": {"backend": "cpu", "devices": 2, "dashboard": None}},
    )
    cmd = [sys.executable, "-m", "mgpu", "submit", str(job), "--keep-open", "-q", "--json", str(tmp_path / "r.json")]
    said = tmp_path / "stderr.txt"
    with open(said, "w") as err, subprocess.Popen(cmd, cwd=ROOT, stderr=err, text=True) as proc:
        wait_for(lambda: "kept open" in said.read_text() or proc.poll() is not None, 120, "the job's end")
        assert proc.poll() is None, said.read_text()
        command = psutil.Process(proc.pid)
        servers = [p for p in command.children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        assert len(servers) == 1
        # The cluster's two workers are the server's children, not the command's.
        assert len(servers[0].children()) == 2
        everything = command.children(recursive=True)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "ok", said.read_text()
    _, alive = psutil.wait_procs(everything, timeout=10)
    assert alive == [], [p.cmdline() for p in alive]


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MGPU_TEST_MARK") == mark:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def test_a_submit_refused_at_once_leaves_no_server_importing(tmp_path):
    mark = str(uuid.uuid4())
    env = {**os.environ, "MGPU_TEST_MARK": mark}
    cmd = [sys.executable, "-m", "mgpu", "submit", str(tmp_path / "missing.yaml")]
    said = tmp_path / "stderr.txt"
    with open(said, "w") as err:  # a file: a pipe would be read until the server, holding it too, ended
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=60)
    assert done.returncode == 2, said.read_text()
    assert "Traceback" not in said.read_text()
    # The server the command started, still importing when it ended, ended with it; the
    # resource tracker it started reads to the end of its pipe, then ends on its own.
    marked = _marked(mark)
    trackers = [p for p in marked if _is_resource_tracker(p)]
    _, alive = psutil.wait_procs([p for p in marked if p not in trackers], timeout=0)
    assert alive == [], [p.cmdline() for p in alive]
    _, alive = psutil.wait_procs(trackers, timeout=30)
    assert alive == [], [p.cmdline() for p in alive]


def _is_resource_tracker(proc: psutil.Process) -> bool:
    try:
        return any("multiprocessing.resource_tracker" in arg for arg in proc.cmdline())
    except psutil.Error:  # ended meanwhile
        return False
