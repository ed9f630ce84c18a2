"""The ``mgpu`` command collects no garbage while it imports and starts, collects again
once its cluster is ready (or at once, for every command but submit), and leaves nothing
for the interpreter's last collection; mgpu imported as a library leaves the collector
alone (each case in a fresh interpreter told how it was started). A worker of a cluster
mgpu starts collects nothing until its runtime is made; one of a cluster it joins keeps
its collector."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import psutil
import pytest
from distributed import Client

COMMAND = "sys.orig_argv = [sys.executable, '-m', 'mgpu', 'submit', 'job.yaml']"
LIBRARY = "sys.orig_argv = [sys.executable, 'program.py']"
WORKER = "sys.orig_argv = [sys.executable, '-c', 'from multiprocessing.spawn import spawn_main']"


def collector_after(started_as: str, code: str, tmp_path) -> dict:
    """The collector's state after ``code`` in an interpreter started as ``started_as``
    says; ``code`` appends its observations to ``seen``."""
    script = f"import sys\n{started_as}\nimport gc\nseen = {{}}\n{textwrap.dedent(code)}\n"
    script += "print(json.dumps(seen))"
    proc = subprocess.run(
        [sys.executable, "-c", "import json\n" + script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_command_imports_without_the_collector_and_resumes_it_frozen(tmp_path):
    seen = collector_after(
        COMMAND,
        """
        import mgpu.cli
        seen["importing"] = gc.isenabled()
        from mgpu.lifetime import resume_collection
        resume_collection()
        seen["resumed"] = gc.isenabled()
        seen["frozen"] = gc.get_freeze_count()
        resume_collection()  # once only: nothing more is frozen
        seen["again"] = gc.get_freeze_count()
        """,
        tmp_path,
    )
    assert seen["importing"] is False
    assert seen["resumed"] is True and seen["frozen"] > 10_000
    assert seen["again"] == seen["frozen"]


@pytest.mark.parametrize("started_as", [LIBRARY, WORKER], ids=["library", "worker"])
def test_a_program_or_a_worker_keeps_its_collector(tmp_path, started_as):
    seen = collector_after(
        started_as,
        """
        import mgpu.cli
        seen["importing"] = gc.isenabled()
        from mgpu.lifetime import finish, resume_collection
        resume_collection()
        finish()
        seen["frozen"] = gc.get_freeze_count()
        """,
        tmp_path,
    )
    assert seen == {"importing": True, "frozen": 0}


def test_commands_but_submit_collect_from_their_start(tmp_path):
    seen = collector_after(
        COMMAND,
        """
        from click.testing import CliRunner
        from mgpu.cli import cli
        result = CliRunner().invoke(cli, ["submit", "missing.yaml"])
        seen["submit"] = [result.exit_code, gc.isenabled()]
        result = CliRunner().invoke(cli, ["report", "missing.json"])
        seen["report"] = [result.exit_code, gc.isenabled()]
        """,
        tmp_path,
    )
    # A submit that fails its checks exits before its cluster would be ready: still paused.
    assert seen == {"submit": [2, False], "report": [2, True]}


def test_a_submit_collects_again_once_its_cluster_is_ready(tmp_path):
    (tmp_path / "job.yaml").write_text(
        "workload: dot\nparams: {n: 1000}\ncluster: {backend: cpu, devices: 1, dashboard: null}\n"
    )
    seen = collector_after(
        COMMAND,
        """
        from click.testing import CliRunner
        from mgpu.cli import cli
        import mgpu.cli
        ready = mgpu.cli._Reporter.cluster_ready

        def spy(self, info):
            ready(self, info)
            seen["at cluster_ready"] = gc.isenabled()

        mgpu.cli._Reporter.cluster_ready = spy
        seen["before"] = gc.isenabled()
        result = CliRunner().invoke(cli, ["submit", "job.yaml", "-q", "--own-cluster"])
        seen["exit"] = result.exit_code
        """,
        tmp_path,
    )
    assert seen == {"before": False, "at cluster_ready": True, "exit": 0}


def _collector(dask_worker: Any = None) -> dict[str, Any]:
    import gc

    return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}


def test_a_worker_mgpu_starts_collects_again_once_its_runtime_is_made():
    from mgpu.cluster import ResolvedCluster, _start_cpu
    from mgpu.worker.plugins import RuntimeSetup

    rc = ResolvedCluster("cpu", [0], "default", "tcp", "auto", None, None)
    with _start_cpu(rc) as cluster, Client(cluster) as client:
        # Started with the collector paused (the preload), as its imports run.
        assert [s["enabled"] for s in client.run(_collector).values()] == [False]
        client.register_plugin(RuntimeSetup("cpu"))
        (after,) = client.run(_collector).values()
        assert after["enabled"] and after["frozen"] > 10_000


def test_a_worker_mgpu_joins_keeps_its_collector():
    from conftest import start_local_cluster

    from mgpu.worker.plugins import RuntimeSetup

    with start_local_cluster() as cluster, Client(cluster) as client:
        assert all(s["enabled"] for s in client.run(_collector).values())
        client.register_plugin(RuntimeSetup("cpu"))
        assert [s["frozen"] for s in client.run(_collector).values()] == [0, 0]


def ended(started_as: str, code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    """An interpreter started as ``started_as`` says that registers an exit handler, prints
    a line (buffered: its output is a pipe) and runs ``code``."""
    script = (
        f"import atexit, sys, threading, time\n{started_as}\n"
        "atexit.register(lambda: print('exit handler ran', flush=True))\n"
        "print('result line')\n"
        f"{textwrap.dedent(code)}\n"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_command_ends_at_once_with_its_output_flushed(tmp_path):
    proc = ended(COMMAND, "from mgpu.lifetime import end\nend(3)", tmp_path)
    assert proc.returncode == 3
    assert proc.stdout == "result line\n"  # flushed; the interpreter's teardown never ran
    proc = ended(COMMAND, "from mgpu.lifetime import end\nend('mgpu: failed')", tmp_path)
    assert (proc.returncode, proc.stderr) == (1, "mgpu: failed\n")


def test_the_command_exits_the_ordinary_way_while_something_still_runs(tmp_path):
    code = """
    from mgpu.lifetime import end
    threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()
    end(4)
    """
    proc = ended(COMMAND, code, tmp_path)
    assert proc.returncode == 4
    assert proc.stdout.splitlines() == ["result line", "thread done", "exit handler ran"]


def test_the_command_exits_the_ordinary_way_while_a_dask_client_is_open(tmp_path):
    code = """
    from distributed import Client
    from mgpu.lifetime import end
    client = Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None)
    end(5)
    """
    proc = ended(COMMAND, code, tmp_path)
    assert proc.returncode == 5
    assert "exit handler ran" in proc.stdout


def test_a_program_ending_through_mgpu_exits_the_ordinary_way(tmp_path):
    proc = ended(LIBRARY, "from mgpu.lifetime import end\nend(3)", tmp_path)
    assert (proc.returncode, proc.stdout) == (3, "result line\nexit handler ran\n")


def test_the_command_ending_at_once_stops_its_fork_server(tmp_path):
    code = """
    from mgpu import forkserver
    from mgpu.lifetime import end
    forkserver.start()
    print(forkserver._server()._forkserver_pid, flush=True)
    end(0)
    """
    proc = ended(COMMAND, code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    server = int(proc.stdout.splitlines()[-1])
    # Ended with the command, not once its imports are done.
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
