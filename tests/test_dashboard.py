"""The Dask dashboard of the clusters mgpu starts: on at the address asked for, off with
``--no-dashboard``, mgpu's tasks under readable names in the task stream, and
``submit --keep-open`` checked in a real headless chromium (Debian's, installed by .ci/run)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import invoke, wait_for, write_job
from dask.utils import key_split

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

needs_chromium = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver): "
    "apt-get install chromium chromium-driver, as .ci/run does",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- task names --------------------------------------------------------------------------------


def test_mgpu_tasks_have_readable_names_in_the_task_stream(tmp_path, scheduler):
    """The dashboard names a task by ``key_split(key)``: mgpu's keys must split to what they do.

    mgpu opens the task stream when it connects, so tasks are recorded even if nobody had the
    dashboard open while they ran.
    """
    from distributed import Client

    jobs = {
        "dot": {"n": 4000},
        "matmul": {"m": 64, "n": 64, "k": 64},
        "mandelbrot": {"width": 64, "height": 48, "max_iter": 20},
    }
    for workload, params in jobs.items():
        job = write_job(tmp_path / f"{workload}.yaml", {"workload": workload, "params": params})
        res = invoke("submit", job, "--scheduler", scheduler, "-q")
        assert res.code == 0, res.output
    with Client(scheduler) as client:
        names = {key_split(t["key"]) for t in client.get_task_stream()}
    for workload in jobs:
        assert {f"{workload}-tile", f"{workload}-warmup"} <= names, names


# -- choosing the dashboard --------------------------------------------------------------------


def test_no_dashboard_starts_none_and_a_bad_address_is_refused(tmp_path):
    job = write_job(
        tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 1000}, "cluster": {"backend": "cpu", "devices": 1}}
    )
    res = invoke("submit", job, "--no-dashboard")
    assert res.code == 0, res.output
    assert "running on 1 CPU worker" in res.stdout and "dashboard" not in res.output

    res = invoke("submit", job, "--dashboard", "localhost")
    assert res.code == 2, res.output
    assert "cluster.dashboard: expected HOST:PORT" in res.stderr and "Traceback" not in res.output


# -- the dashboard in a browser ------------------------------------------------------------------


class _Lines:
    """A child's output, read on a thread, so a test can wait for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} in {timeout} s; output so far:\n{''.join(self.seen)}")

    def rest(self, timeout: float) -> str:
        """Everything the child wrote, waiting up to ``timeout`` for the end of its output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return "".join(self.seen)


def _browser(profile: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(arg)
    options.binary_location = str(CHROMIUM)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


# What the status page's Bokeh documents hold: their roots, and every name in their data
# sources (the task stream's rectangles are drawn on a canvas, named in its source).
_BOKEH_STATE = """
if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
const names = new Set(); let roots = 0; let idle = true;
for (const doc of Bokeh.documents) {
  roots += doc.roots().length;
  idle = idle && doc.is_idle;  // every root's view has drawn
  for (const model of doc.all_models) {
    const data = model.data;
    if (!data) continue;
    const column = data instanceof Map ? data.get("name") : data["name"];
    if (column) for (const name of column) names.add(String(name));
  }
}
return {roots: roots, idle: idle, names: Array.from(names)};
"""


@needs_chromium
def test_keep_open_dashboard_renders_in_chromium_with_mgpu_task_names(tmp_path):
    port = _free_port()
    job = write_job(
        tmp_path / "mm.yaml",
        {
            "workload": "matmul",
            "params": {"m": 256, "n": 256, "k": 128},
            "tiling": {"m": 64, "n": 128},
            "cluster": {"backend": "cpu", "devices": 2},
        },
    )
    out = tmp_path / "result.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mgpu",
            "submit",
            str(job),
            "--keep-open",
            "--dashboard",
            f"127.0.0.1:{port}",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
    )
    lines = _Lines(proc)
    try:
        lines.wait_for(f"mgpu: dashboard http://127.0.0.1:{port}/status", timeout=120)
        kept = lines.wait_for("press Ctrl-C to close", timeout=120)
        assert f"dashboard http://127.0.0.1:{port}/status" in kept
        assert "passed" in "".join(lines.seen)  # the result table came before the wait

        driver = _browser(tmp_path / "chromium-profile")
        try:
            driver.get(f"http://127.0.0.1:{port}/status")
            states: list[Any] = []

            def drawn() -> bool:  # the page draws, then the server streams the task stream in
                states.append(driver.execute_script(_BOKEH_STATE))
                return bool(states[-1] and states[-1]["idle"] and "matmul-tile" in states[-1]["names"])

            try:
                wait_for(drawn, 30, "the drawn dashboard with mgpu's tasks", interval=0.25)
            except TimeoutError:
                pass  # the assertions say what is missing
            state = states[-1]
            assert driver.title == "Dask: Status"
            assert state is not None and state["roots"] >= 3, state  # task stream, memory, progress, ...
            assert state["idle"], state
            assert {"matmul-tile", "matmul-warmup"} <= set(state["names"]), state
            shot = tmp_path / "dashboard.png"
            assert driver.save_screenshot(str(shot))
            assert shot.read_bytes()[:8] == PNG_SIGNATURE and shot.stat().st_size > 10_000
            if os.environ.get("MGPU_DASHBOARD_PNG"):  # refresh the README's picture
                shutil.copy(shot, os.environ["MGPU_DASHBOARD_PNG"])

            driver.get(f"http://127.0.0.1:{port}/info/main/workers.html")
            assert driver.page_source.count("tcp://127.0.0.1:") >= 2  # both workers listed
        finally:
            driver.quit()

        proc.send_signal(signal.SIGTERM)  # as Ctrl-C: the cluster closes and the run ends well
        assert proc.wait(timeout=60) == 0, lines.rest(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads(out.read_text())["status"] == "ok"
    with socket.socket() as s, pytest.raises(OSError):
        s.connect(("127.0.0.1", port))  # the dashboard is gone with the cluster
