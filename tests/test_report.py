"""``mgpu report``: saved results (``submit --json``) and scale JSON -> table, CSV/JSON, plots;
medians, spread and efficiency; bad input is one clear message with exit 2."""

from __future__ import annotations

import copy
import json
import statistics

import pytest
from conftest import invoke, submit_json, write_job

from mgpu.report import summarize, with_efficiency, write_json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory, scheduler):
    """Two real Result JSON files of the same small dot job on the shared 2-worker cluster."""
    tmp = tmp_path_factory.mktemp("results")
    job = write_job(tmp / "dot.yaml", {"workload": "dot", "params": {"n": 5000}})
    paths = []
    for i in range(2):
        res, data = submit_json(job, tmp / f"r{i}.json", "--scheduler", scheduler)
        assert res.code == 0 and data["status"] == "ok", res.output
        paths.append(tmp / f"r{i}.json")
    return paths


def _row(devices, throughput, *, status="ok", allocator="pool", repeat=0):
    return {
        "job": "j",
        "workload": "dot",
        "mode": "strong",
        "devices": devices,
        "size": "n=10",
        "base_size": "n=10",
        "repeat": repeat,
        "status": status,
        "seconds": 1.0 / throughput,
        "wall_s": 2.0,
        "throughput": throughput,
        "unit": "GB/s",
        "roofline_fraction": 0.5,
        "efficiency": None,
        "backend": "cuda",
        "allocator": allocator,
        "protocol": "tcp",
        "host": "h",
        "gpu": "g",
        "source": "s",
    }


# -- the arithmetic ---------------------------------------------------------------------------


def test_efficiency_is_against_the_median_at_the_fewest_devices_and_skips_failed_runs():
    rows = [_row(1, 10), _row(1, 12), _row(1, 50, status="failed"), _row(2, 18), _row(2, 22), _row(4, 30)]
    out = with_efficiency(rows)
    assert [r["efficiency"] for r in out] == pytest.approx([10 / 11, 12 / 11, None, 18 / 22, 22 / 22, 30 / 44])
    summary = {s["devices"]: s for s in summarize(rows)}
    assert summary[1]["runs"] == 3 and summary[1]["failed"] == 1
    assert summary[1]["throughput_median"] == 11  # the failed run's 50 does not count
    assert summary[2]["efficiency"] == pytest.approx(20 / 22)
    assert (summary[2]["efficiency_min"], summary[2]["efficiency_max"]) == pytest.approx((18 / 22, 1.0))
    assert summary[4]["efficiency"] == pytest.approx(30 / 44)


def test_baseline_is_the_fewest_devices_swept_and_series_are_kept_apart():
    rows = [_row(2, 20), _row(4, 30), _row(2, 10, allocator="async"), _row(4, 20, allocator="async")]
    by_alloc = {(s["allocator"], s["devices"]): s for s in summarize(rows, ["allocator"])}
    assert by_alloc[("pool", 4)]["efficiency"] == pytest.approx(30 / 40)
    assert by_alloc[("async", 4)]["efficiency"] == pytest.approx(20 / 20)
    assert by_alloc[("pool", 4)]["baseline_devices"] == 2
    # One device count alone scales nothing: no efficiency rather than a vacuous 100%.
    assert summarize([_row(2, 20), _row(2, 21)])[0]["efficiency"] is None


# -- the command ------------------------------------------------------------------------------


def test_report_tabulates_saved_results(results, tmp_path):
    res = invoke("report", *results, "--out", tmp_path / "rep")
    assert res.code == 0, res.output
    assert "n=5000" in res.stdout and "GB/s" in res.stdout
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 and [r["repeat"] for r in rows] == [0, 1]
    assert {r["source"] for r in rows} == {"r0.json", "r1.json"}
    saved = [json.loads(p.read_text()) for p in results]
    assert [r["throughput"] for r in rows] == pytest.approx([s["throughput"]["value"] for s in saved])
    assert data["summary"][0]["throughput_median"] == pytest.approx(
        statistics.median(s["throughput"]["value"] for s in saved)
    )
    assert (tmp_path / "rep" / "throughput.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "report.csv" in res.stderr and (tmp_path / "rep" / "REPORT.md").read_text().count("| ") >= 2


def test_report_reads_the_list_submit_json_writes_for_several_jobs(results, tmp_path):
    listed = tmp_path / "jobs.json"
    listed.write_text(json.dumps([json.loads(p.read_text()) for p in results]))
    res = invoke("report", listed, "--out", tmp_path / "rep")
    assert res.code == 0, res.output
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]
    assert len(rows) == 2 and [r["repeat"] for r in rows] == [0, 1] and {r["source"] for r in rows} == {"jobs.json"}


def test_report_compares_allocators_side_by_side(results, tmp_path):
    other = copy.deepcopy(json.loads(results[0].read_text()))
    other["env"]["allocator"] = "async"
    other["throughput"]["value"] *= 2
    (tmp_path / "async.json").write_text(json.dumps(other))
    res = invoke("report", *results, tmp_path / "async.json", "--by", "allocator", "--out", tmp_path / "rep")
    assert res.code == 0, res.output
    summary = json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]
    by = {s["allocator"]: s for s in summary}
    assert set(by) == {"numpy", "async"} and by["numpy"]["runs"] == 2 and by["async"]["runs"] == 1
    assert by["async"]["throughput_median"] == pytest.approx(other["throughput"]["value"])
    assert "allocator" in res.stdout and "async" in res.stdout
    from matplotlib.image import imread

    assert imread(tmp_path / "rep" / "throughput.png").shape[0] > 100


def test_report_reads_scale_json_and_recomputes_efficiency(tmp_path):
    rows = [_row(1, 10), _row(1, 14, repeat=1), _row(2, 20), _row(2, 22, repeat=1)]
    write_json(tmp_path / "scale.json", rows, [])
    res = invoke("report", tmp_path / "scale.json", "--out", tmp_path / "rep")
    assert res.code == 0, res.output
    summary = {s["devices"]: s for s in json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]}
    assert summary[2]["efficiency"] == pytest.approx(21 / (2 * 12))
    assert (tmp_path / "rep" / "efficiency.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "does not exist"),
        ("not json {", "is not JSON"),
        ('{"status": "ok"}', "is not an mgpu result"),
        ("[1, 2]", "is not an mgpu result"),
        ('{"kind": "mgpu-scale", "rows": [{"devices": 1}]}', "lacks fields"),
    ],
)
def test_report_bad_input_is_one_message_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    res = invoke("report", path)
    assert res.code == 2, res.output
    assert res.stderr.startswith("mgpu: error: ") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_report_rejects_an_unknown_by_field(results):
    res = invoke("report", results[0], "--by", "colour")
    assert res.code == 2 and "--by" in res.stderr and "allocator" in res.stderr


# -- what reading results imports ----------------------------------------------------------


def test_making_a_report_imports_neither_the_client_nor_distributed(results, tmp_path):
    """Results are read and written up without the execution stack: no mgpu client, cluster
    or scale sweep, and none of distributed (its client and deployment machinery above all)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "import mgpu.report as report\n"
        f"rows = report.load_rows({[str(p) for p in results]!r})\n"
        f"report.write_report(Path({str(tmp_path)!r}), rows, title='t', lines=[])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "mgpu.report" in loaded and "mgpu.plots" in loaded  # the report was made
    assert (tmp_path / "REPORT.md").exists()
    heavy = ("distributed", "mgpu.client", "mgpu.cluster", "mgpu.scale", "mgpu.worker.plugins", "dask_cuda")
    assert sorted(m for m in loaded if m.split(".")[0] in heavy or m.startswith(heavy)) == []
