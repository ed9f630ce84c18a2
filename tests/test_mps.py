"""NVIDIA's MPS for workers sharing a GPU (mgpu.mps): a control daemon private to the
cluster, its folder handed to the workers and to no one else, stopped with the cluster;
workers under it take no turns. A script stands in for NVIDIA's control program here; the
real one runs in the GPU tests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_sharing import _FakeLocalCUDACluster, _gpu

from mgpu import background, mps
from mgpu import cluster as cluster_mod
from mgpu.client.result import _devices
from mgpu.cluster import ClusterInfo, ResolvedCluster, turn_takers
from mgpu.cuda_cluster import start_cuda_cluster
from mgpu.errors import JobInputError
from mgpu.spec import validate_job

# What NVIDIA's control program does that mgpu relies on: with -d it starts a daemon whose
# pipe appears in CUDA_MPS_PIPE_DIRECTORY; given "quit" on stdin, the daemon goes.
_CONTROL = """#!/bin/sh
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{calls}"
if [ "$1" = "-d" ]; then
    {start}
    : > "$CUDA_MPS_PIPE_DIRECTORY/control"
    exit 0
fi
read command
echo "stdin=$command" >> "{calls}"
rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


def _control(tmp_path: Path, start: str = "") -> tuple[str, Path]:
    calls = tmp_path / "calls.txt"
    program = tmp_path / "bin" / mps.CONTROL
    program.parent.mkdir()
    program.write_text(_CONTROL.format(calls=calls, start=start))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return str(program), calls


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_daemon_of_its_own_is_reached_through_its_folder_and_quits_once(tmp_path, private_tmp, monkeypatch):
    program, calls = _control(tmp_path)
    daemon = mps.start_daemon(program)
    pipe, log = daemon.env["CUDA_MPS_PIPE_DIRECTORY"], daemon.env["CUDA_MPS_LOG_DIRECTORY"]
    assert Path(pipe).parent == Path(log).parent == daemon.folder and daemon.folder.parent == private_tmp
    assert calls.read_text().splitlines() == [f"-d pipe={pipe} log={log}"]
    # A worker given the folder finds the daemon; one given none looks where the driver would.
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe)
    assert mps.under_mps()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "elsewhere"))
    assert not mps.under_mps()
    daemon.stop()
    daemon.stop()
    assert calls.read_text().splitlines()[1:] == [f" pipe={pipe} log={log}", "stdin=quit"]
    assert not daemon.folder.exists()


def test_a_daemon_that_does_not_start_says_why_and_leaves_nothing(tmp_path, private_tmp):
    program, _ = _control(tmp_path, start='echo "cannot open the GPU" >&2; exit 3')
    with pytest.raises(RuntimeError, match=r"-d exited with 3: cannot open the GPU"):
        mps.start_daemon(program)
    assert list(private_tmp.iterdir()) == []


def test_cluster_mps_is_used_where_installed_and_refused_where_asked_for_but_missing(monkeypatch):
    monkeypatch.setattr(mps, "control_program", lambda: None)
    assert cluster_mod._mps_program("auto") is None and cluster_mod._mps_program(False) is None
    with pytest.raises(JobInputError, match=r"cluster.mps: true needs NVIDIA's nvidia-cuda-mps-control on PATH"):
        cluster_mod._mps_program(True)
    monkeypatch.setattr(mps, "control_program", lambda: "/opt/nvidia/control")
    assert cluster_mod._mps_program("auto") == cluster_mod._mps_program(True) == "/opt/nvidia/control"
    assert cluster_mod._mps_program(False) is None


def test_a_daemon_that_does_not_start_fails_a_job_that_asked_for_it_and_else_leaves_turns(tmp_path, private_tmp):
    program, _ = _control(tmp_path, start='echo "no MPS here" >&2; exit 1')
    rc = ResolvedCluster("cuda", [0], "pool", "tcp", "auto", None, None, workers_per_device=2, mps=program)
    with pytest.raises(JobInputError, match=r"cluster.mps: true, but .* exited with 1: no MPS here; use auto or false"):
        cluster_mod._start_mps(ResolvedCluster(**{**rc.__dict__, "mps_required": True}))
    with pytest.warns(RuntimeWarning, match=r"no MPS here: the workers sharing a GPU take turns at it instead"):
        assert cluster_mod._start_mps(rc) is None
    assert cluster_mod._start_mps(ResolvedCluster(**{**rc.__dict__, "mps": None})) is None


class _ClosingCluster(_FakeLocalCUDACluster):
    async def _close(self) -> None:
        self.closed = True


def test_every_worker_sharing_a_gpu_gets_the_daemon_which_stops_with_the_cluster(tmp_path, private_tmp, monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=_ClosingCluster))
    program, calls = _control(tmp_path)
    daemon = mps.start_daemon(program)
    cluster = start_cuda_cluster([0, 1], 2, daemon)
    envs = {name: spec["options"]["env"] for name, spec in cluster.worker_spec.items()}
    assert envs == {
        f"{d}-{k}": {"CUDA_VISIBLE_DEVICES": "0,1" if d == 0 else "1", **daemon.env} for d in (0, 1) for k in (0, 1)
    }
    assert not daemon.stopped
    asyncio.run(cluster._close())
    assert cluster.closed and daemon.stopped and not daemon.folder.exists()
    assert calls.read_text().splitlines()[-1] == "stdin=quit"


def test_workers_under_mps_take_no_turns_and_the_result_says_how_a_gpu_was_shared():
    def facts(mps_on: bool) -> dict[str, Any]:
        return {
            "w0": dataclasses.replace(_gpu("GPU-a"), mps=mps_on),
            "w1": dataclasses.replace(_gpu("GPU-a"), mps=mps_on),
            "w2": _gpu("GPU-b", 1),
        }

    assert turn_takers(facts(False)) == {"w0": 2, "w1": 2}
    assert turn_takers(facts(True)) == {}
    rc = ResolvedCluster("cuda", [0, 1], "pool", "tcp", "auto", None, None)
    for on, how in ((True, "mps"), (False, "turns")):
        rows = _devices(ClusterInfo(client=None, resolved=rc, owned=True, devices=facts(on)))  # type: ignore[arg-type]
        assert [(r["workers"], r.get("sharing")) for r in rows] == [(2, how), (1, None)]


def test_a_cluster_mps_that_is_neither_a_choice_nor_a_yes_or_no_is_refused_naming_the_key():
    job = {"workload": "dot", "params": {"n": 10}, "cluster": {"mps": "sometimes"}}
    with pytest.raises(JobInputError, match=r"cluster.mps"):
        validate_job(job)
    assert validate_job({**job, "cluster": {"mps": False}}).cluster.mps is False
    assert validate_job({**job, "cluster": {}}).cluster.mps == "auto"
    assert os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is None  # nothing above leaked into this process


def _record(path: Path, proc: subprocess.Popen, daemon: mps.MpsDaemon) -> None:
    created = psutil.Process(proc.pid).create_time()
    running = background.Running(
        "tcp://127.0.0.1:1", None, proc.pid, created, "cuda", 2, "log", mps=(daemon.program, str(daemon.folder))
    )
    path.write_text(json.dumps(dataclasses.asdict(running)))


@pytest.mark.parametrize("closes", [False, True])
def test_down_stops_the_daemon_of_a_cluster_it_had_to_kill(tmp_path, private_tmp, monkeypatch, closes):
    # A cluster's process that ignores SIGTERM (a close that hangs) is killed with its
    # process group; its MPS daemon, detached from that group, is told to quit after it. One
    # that closes stopped its daemon itself (its folder is gone): down leaves it be.
    program, calls = _control(tmp_path)
    daemon = mps.start_daemon(program)
    if closes:
        daemon.stop()
    said = len(calls.read_text().splitlines())
    holder = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", holder], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()  # SIGTERM is ignored from here on
    monkeypatch.setattr(background, "record_path", lambda: tmp_path / "cluster.json")
    _record(tmp_path / "cluster.json", proc, daemon)
    assert background.down(timeout=0.5) is not None
    proc.wait(10)  # gone long before its minute (down's wait reaps it: no exit code is left here)
    proc.stdout.close()
    quits = calls.read_text().splitlines()[said:]
    assert quits == (
        []
        if closes
        else [f" pipe={daemon.env['CUDA_MPS_PIPE_DIRECTORY']} log={daemon.env['CUDA_MPS_LOG_DIRECTORY']}", "stdin=quit"]
    )
    assert not daemon.folder.exists() and not (tmp_path / "cluster.json").exists()
