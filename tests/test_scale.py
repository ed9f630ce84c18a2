"""``mgpu scale``: parsing and planning the sweep, real sweeps on 1, 2, 3 and on 4 and 8 CPU
workers, weak scaling, and the files a sweep writes (CSV, JSON, PNG, REPORT.md)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import invoke, write_job

from mgpu.errors import JobFailed, JobInputError
from mgpu.report import size_label
from mgpu.scale import NOT_RUN, counts_up_to, default_counts, parse_counts, parse_sizes, plan_sweep, run_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Small enough that a run is mostly cluster start-up; several tiles so every worker works.
DOT = {"workload": "dot", "params": {"n": 40_000}, "cluster": {"backend": "cpu", "dashboard": None}}


def _png_ok(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def _median_efficiency(rows: list[dict], devices: int) -> float:
    """Efficiency recomputed from the rows: median throughput at N over N x the 1-device median."""
    base = statistics.median(r["throughput"] for r in rows if r["devices"] == 1)
    return statistics.median(r["throughput"] for r in rows if r["devices"] == devices) / (devices * base)


# -- parsing and planning (no cluster) ------------------------------------------------------


def test_parse_counts_sorts_and_rejects_bad_counts():
    assert parse_counts("4,1,2") == [1, 2, 4]
    for bad in ("", "0,1", "a", "1,1", "-1"):
        with pytest.raises(JobInputError, match="--devices"):
            parse_counts(bad)


def test_counts_run_by_powers_of_two_up_to_the_most(monkeypatch):
    assert counts_up_to(1) == [1] and counts_up_to(2) == [1, 2]
    assert counts_up_to(8) == [1, 2, 4, 8] and counts_up_to(6) == [1, 2, 4, 6]
    monkeypatch.setattr("mgpu.scale.os.cpu_count", lambda: 6)
    assert default_counts("cpu") == [1, 2, 4, 6]
    assert default_counts("cpu", most=4) == [1, 2, 4]  # the harness keeps CPU sweeps small


def test_parse_sizes_reads_keys_and_values():
    assert parse_sizes("params.n=1e8,2.5e8") == (["n"], [100_000_000, 250_000_000])
    assert parse_sizes("m,n,k=2048,4096") == (["m", "n", "k"], [2048, 4096])
    for bad in ("n", "n=", "n=1.5", "n=abc", "=4", "n=0"):
        with pytest.raises(JobInputError, match="--sizes"):
            parse_sizes(bad)


@pytest.fixture
def eight_cores(monkeypatch):
    """A machine of eight cores (CPU workers are one a core; a sweep checks its counts)."""
    monkeypatch.setattr("mgpu.cluster.os.cpu_count", lambda: 8)


def test_strong_sweep_keeps_the_size_and_sets_the_device_count(tmp_path, eight_cores):
    job = write_job(tmp_path / "mm.yaml", {"workload": "matmul", "params": {"m": 64, "n": 32, "k": 16}})
    runs = plan_sweep(job, [1, 2, 4], 3)
    assert [(r.devices, r.repeat) for r in runs] == [(n, i) for n in (1, 2, 4) for i in range(3)]
    assert all(r.job.cluster.devices == r.devices for r in runs)
    assert all((r.job.params.m, r.job.params.n, r.job.params.k) == (64, 32, 16) for r in runs)
    assert {r.mode for r in runs} == {"strong"}


def test_weak_sweep_grows_the_workload_default_or_the_jobs_scale_grow(tmp_path, eight_cores):
    job = write_job(tmp_path / "mm.yaml", {"workload": "matmul", "params": {"m": 64, "n": 32, "k": 16}})
    runs = plan_sweep(job, [1, 2, 8], 1, weak=True)
    # matmul grows m by default: the work (m*n*k) grows with the device count.
    assert [(r.job.params.m, r.job.params.n, r.job.params.k) for r in runs] == [
        (64, 32, 16),
        (128, 32, 16),
        (512, 32, 16),
    ]
    assert all(r.base_size == {"m": 64, "n": 32, "k": 16} for r in runs)

    two = write_job(
        tmp_path / "mb.yaml",
        {"workload": "mandelbrot", "params": {"width": 100, "height": 50}, "scale": {"grow": ["width", "height"]}},
    )
    runs = plan_sweep(two, [1, 4], 1, weak=True)
    # Two keys share the growth: each by the square root, so the pixels grow by 4.
    assert [(r.job.params.width, r.job.params.height) for r in runs] == [(100, 50), (200, 100)]


def test_sizes_sweep_runs_every_size_on_every_count(tmp_path):
    job = write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 10}})
    runs = plan_sweep(job, [1, 2], 2, sizes=parse_sizes("n=1e3,4e3"))
    assert [(r.job.params.n, r.devices) for r in runs] == [
        (1000, 1),
        (1000, 1),
        (1000, 2),
        (1000, 2),
        (4000, 1),
        (4000, 1),
        (4000, 2),
        (4000, 2),
    ]


def test_a_sweep_over_workers_per_device_runs_each_at_every_count(tmp_path, eight_cores):
    job = write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 10}, "cluster": {"backend": "cpu"}})
    runs = plan_sweep(job, [1, 2], 2, workers=[1, 2])
    assert [(r.devices, r.job.cluster.workers_per_device, r.repeat) for r in runs] == [
        (n, w, i) for n in (1, 2) for w in (1, 2) for i in range(2)
    ]
    assert all(f"cluster.workers_per_device={r.job.cluster.workers_per_device}" in r.overrides for r in runs)
    assert {r.workers for r in runs} == {1}  # CPU workers are one a core, whatever was asked
    # Without a list, every count runs with the job's own number, and no override says otherwise.
    assert all("workers_per_device" not in " ".join(r.overrides) for r in plan_sweep(job, [1], 1))


def _fake_run_jobs(monkeypatch, fail: dict[int, str]):
    """Replace the cluster: each call records the jobs it got; a call whose first job is
    the ``i``-th job ever given fails as ``fail[i]`` says ("raise" or "check")."""
    calls: list[list] = []

    def run_jobs(jobs, events=None):
        first = sum(len(c) for c in calls)
        calls.append(jobs)
        how = fail.get(first)
        if how == "raise":
            raise JobFailed("a worker died")
        results = [SimpleNamespace(status="failed" if how == "check" else "ok", job=j) for j in jobs]
        return results[:1] if how == "check" else results  # a failed check ends the batch

    monkeypatch.setattr("mgpu.scale.run_jobs", run_jobs)
    return calls


def test_a_sweep_runs_each_layout_on_one_cluster_and_goes_on_past_a_failure(tmp_path, eight_cores, monkeypatch):
    job = write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 10}, "cluster": {"backend": "cpu"}})
    runs = plan_sweep(job, [1, 2, 4], 2)
    calls = _fake_run_jobs(monkeypatch, {0: "raise", 2: "check"})
    outcomes = list(run_sweep(runs, one_cluster=True, keep_going=True))
    assert [[j.cluster.devices for j in c] for c in calls] == [[1, 1], [2, 2], [4, 4]]
    assert [o.run for o in outcomes] == runs
    assert [(o.verified, o.error) for o in outcomes] == [
        (False, "a worker died"),
        (False, "a worker died"),
        (False, None),  # ran, and its check failed
        (False, NOT_RUN),
        (True, None),
        (True, None),
    ]
    # The first run of a job keeps outputs already there; its later runs replace its own.
    assert [j.force for c in calls for j in c] == [False, True, True, True, True, True]


def test_a_sweep_stops_at_a_failure_unless_told_to_go_on(tmp_path, eight_cores, monkeypatch):
    job = write_job(tmp_path / "dot.yaml", {"workload": "dot", "params": {"n": 10}, "cluster": {"backend": "cpu"}})
    runs = plan_sweep(job, [1, 2], 1)
    calls = _fake_run_jobs(monkeypatch, {1: "raise"})
    done = []
    with pytest.raises(JobFailed, match="a worker died"):
        for outcome in run_sweep(runs, force=True):
            done.append(outcome)
    assert [o.run.devices for o in done] == [1] and done[0].verified
    assert [len(c) for c in calls] == [1, 1]  # a cluster each
    assert calls[0][0].force  # --force: the first run replaces outputs too


@pytest.mark.parametrize(
    "doc,kwargs,message",
    [
        (
            {"workload": "dot", "params": {"n": 10}, "scale": {"grow": ["m"]}},
            {},
            "scale.grow: 'm' is not a size of dot; allowed: n",
        ),
        (
            {"workload": "dot", "params": {"n": 10}, "scale": {"shrink": ["n"]}},
            {},
            "scale.shrink: unknown key; allowed: grow",
        ),
        (
            {"workload": "dot", "params": {"n": 10}},
            {"sizes": (["q"], [1])},
            "--sizes: 'q' is not a size of dot; allowed: n",
        ),
        (
            {"workload": "dot", "params": {"n": 10}, "cluster": {"scheduler": "tcp://127.0.0.1:1"}},
            {},
            "cluster.scheduler: scale starts a fresh cluster",
        ),
    ],
)
def test_plan_sweep_rejects_bad_input_naming_the_key(tmp_path, doc, kwargs, message):
    job = write_job(tmp_path / "job.yaml", doc)
    with pytest.raises(JobInputError) as e:
        plan_sweep(job, [1, 2], 1, **kwargs)
    assert str(e.value).startswith(message)


def test_weak_scaling_needs_random_inputs(tmp_path):
    import numpy as np

    np.save(tmp_path / "x.npy", np.ones(8, np.float32))
    job = write_job(
        tmp_path / "job.yaml",
        {"workload": "dot", "params": {"input": {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "x.npy")}}},
    )
    with pytest.raises(JobInputError, match="params.input: the input files fix the sizes"):
        plan_sweep(job, [1, 2], 1, weak=True)


def test_size_label_names_the_workloads_sizes():
    assert size_label("matmul", {"m": 32768, "n": 32768, "k": 32768, "seed": 0}) == "m=32768 n=32768 k=32768"
    assert size_label("dot", {"n": 2_000_000_000, "seed": 3}) == "n=2e9"
    assert size_label("dot", {"n": 1_234_567}) == "n=1234567"
    assert size_label("mandelbrot", {"width": 640, "height": 480, "max_iter": 9}) == "width=640 height=480"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--devices", "0,1"], "--devices: expected device counts"),
        (["--sizes", "n=x"], "--sizes: 'x' is not a whole number"),
        (["--repeat", "0"], "--repeat"),
        (["--set", "params.n=-1"], "params.n:"),
    ],
)
def test_scale_cli_rejects_bad_input_with_exit_2(tmp_path, args, message):
    job = write_job(tmp_path / "job.yaml", DOT)
    res = invoke("scale", job, "--out", tmp_path / "out", *args)
    assert res.code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.output
    assert not (tmp_path / "out" / "scale.json").exists()


# -- real sweeps on CPU workers ------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_123(tmp_path_factory):
    """``mgpu scale`` over 1, 2 and 3 CPU workers, 2 runs each."""
    tmp = tmp_path_factory.mktemp("sweep")
    job = write_job(tmp / "dot.yaml", DOT)
    with pytest.MonkeyPatch.context() as mp:  # three workers, whatever the cores (one a core)
        mp.setattr("mgpu.cluster.os.cpu_count", lambda: 8)
        res = invoke("scale", job, "--devices", "3,1,2", "--repeat", "2", "--out", tmp / "out")
    return res, tmp / "out"


def test_sweep_writes_one_row_per_run(sweep_123):
    res, out = sweep_123
    assert res.code == 0, res.output
    rows = list(csv.DictReader((out / "scale.csv").open()))
    assert len(rows) == 3 * 2
    assert [(int(r["devices"]), int(r["repeat"])) for r in rows] == [(n, i) for n in (1, 2, 3) for i in range(2)]
    assert {r["status"] for r in rows} == {"ok"} and {r["mode"] for r in rows} == {"strong"}
    assert {r["size"] for r in rows} == {"n=40000"} and {r["unit"] for r in rows} == {"GB/s"}
    assert all(float(r["seconds"]) > 0 and float(r["throughput"]) > 0 for r in rows)
    # Each run kept its full result, and that result ran on as many workers as the row says.
    for r in rows:
        result = json.loads((out / r["source"]).read_text())
        assert len(result["devices"]) == int(r["devices"]) and result["status"] == "ok"
        assert result["throughput"]["value"] == pytest.approx(float(r["throughput"]))


def test_sweep_json_matches_the_csv_and_efficiency_comes_from_medians(sweep_123):
    res, out = sweep_123
    data = json.loads((out / "scale.json").read_text())
    assert data["kind"] == "mgpu-scale" and data["mode"] == "strong" and data["devices"] == [1, 2, 3]
    rows = data["rows"]
    csv_rows = list(csv.DictReader((out / "scale.csv").open()))
    assert [float(r["throughput"]) for r in csv_rows] == pytest.approx([r["throughput"] for r in rows])
    base = statistics.median(r["throughput"] for r in rows if r["devices"] == 1)
    for r in rows:  # each run against the 1-device median
        assert r["efficiency"] == pytest.approx(r["throughput"] / (r["devices"] * base))
    summary = {s["devices"]: s for s in data["summary"]}
    assert sorted(summary) == [1, 2, 3]
    for n, s in summary.items():
        mine = [r for r in rows if r["devices"] == n]
        assert s["runs"] == 2
        assert s["throughput_median"] == pytest.approx(statistics.median(r["throughput"] for r in mine))
        assert s["throughput_min"] == pytest.approx(min(r["throughput"] for r in mine))
        assert s["throughput_max"] == pytest.approx(max(r["throughput"] for r in mine))
        assert s["seconds_median"] == pytest.approx(statistics.median(r["seconds"] for r in mine))
        assert s["efficiency"] == pytest.approx(_median_efficiency(rows, n))
    assert summary[1]["efficiency"] == pytest.approx(1.0)


def test_sweep_draws_plots_and_a_report_embedding_them(sweep_123):
    res, out = sweep_123
    for name in ("throughput.png", "efficiency.png"):
        _png_ok(out / name)
    report = (out / "REPORT.md").read_text()
    assert "![Throughput against devices](throughput.png)" in report
    assert "![Efficiency against devices](efficiency.png)" in report
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3  # header and one line per device count
    assert "median" in report and "min–max" in report


def test_sweep_prints_a_line_per_run_and_no_bar_off_a_terminal(sweep_123):
    res, _ = sweep_123
    lines = [line for line in res.stderr.splitlines() if line.startswith("mgpu: run ")]
    assert len(lines) == 6 and lines[0].startswith("mgpu: run 1/6: 1 device, n=40000, repeat 1/2:")
    assert "tiles/s" not in res.output and "tiles ━" not in res.output
    assert "efficiency" in res.stdout  # the summary table


def test_sweep_refuses_to_overwrite_a_sweep_without_force(sweep_123, tmp_path):
    _, out = sweep_123
    res = invoke("scale", tmp_path / "x.yaml", "--devices", "1", "--out", out)
    assert res.code == 2 and "already holds a sweep" in res.stderr and "--force" in res.stderr


@pytest.mark.slow
def test_sweep_on_4_and_8_cpu_workers(tmp_path, eight_cores):
    """The planner and the sweep work for any device count."""
    job = write_job(
        tmp_path / "mm.yaml",
        {
            "workload": "matmul",
            "params": {"m": 512, "n": 128, "k": 64},
            "cluster": {"backend": "cpu", "dashboard": None},
        },
    )
    res = invoke("scale", job, "--devices", "4,8", "--repeat", "1", "--out", tmp_path / "out", "-q")
    assert res.code == 0, res.output
    assert res.stdout == "" and res.stderr == ""  # -q
    data = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert [r["devices"] for r in data["rows"]] == [4, 8]
    for r in data["rows"]:
        result = json.loads((tmp_path / "out" / r["source"]).read_text())
        assert result["verify"]["passed"] is True
        # Every worker computed a share of C.
        assert len(result["per_device"]) == r["devices"] and all(d["tiles"] >= 1 for d in result["per_device"])
    base = data["rows"][0]["throughput"]  # the fewest devices (4) are the baseline
    assert data["rows"][1]["efficiency"] == pytest.approx(data["rows"][1]["throughput"] / (2 * base))
    _png_ok(tmp_path / "out" / "throughput.png")


def test_weak_sweep_grows_the_problem_with_the_devices(tmp_path):
    job = write_job(tmp_path / "dot.yaml", DOT)
    res = invoke("scale", job, "--devices", "1,2", "--repeat", "1", "--weak", "--out", tmp_path / "out")
    assert res.code == 0, res.output
    data = json.loads((tmp_path / "out" / "scale.json").read_text())
    rows = data["rows"]
    assert data["mode"] == "weak" and [r["size"] for r in rows] == ["n=40000", "n=80000"]
    assert {r["base_size"] for r in rows} == {"n=40000"}
    run2 = json.loads((tmp_path / "out" / rows[1]["source"]).read_text())
    assert run2["job"]["params"]["n"] == 80_000
    # Weak efficiency: T1 / T2 for twice the work on twice the devices, i.e. thr2 / (2 thr1).
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["throughput"] / (2 * rows[0]["throughput"]))


def test_help_lists_scale_and_report_and_their_options():
    res = invoke("-h")
    assert res.code == 0 and "scale" in res.stdout and "report" in res.stdout
    res = invoke("scale", "-h")
    for word in ("JOB_FILE", "--out", "--devices", "--repeat", "--weak", "--sizes", "--set", "--no-dashboard", "-q"):
        assert word in res.stdout
    res = invoke("report", "-h")
    assert res.code == 0 and "--by" in res.stdout and "--out" in res.stdout
