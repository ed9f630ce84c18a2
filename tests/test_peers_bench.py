"""benchmarks/peers.py on CPU: parsing dask-cuda's local_cupy output, the ratio table,
the step commands (job overrides validated by mgpu itself) and the step runner's timeouts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from dask.utils import format_time

from mgpu.spec import load_job

ROOT = Path(__file__).resolve().parents[1]


def _load_peers():
    spec = importlib.util.spec_from_file_location("mgpu_bench_peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


peers = _load_peers()


def _kv(key: str, value: str) -> str:  # dask_cuda.benchmarks.utils.print_key_value
    return f"{key: <25} | {value}"


# What local_cupy prints (pretty_print_results + print_throughput_bandwidth), two runs.
LOCAL_CUPY_OUTPUT = "\n".join(
    [
        "Roundtrip benchmark",
        "-" * 80,
        _kv("Backend", "dask"),
        _kv("Operation", "dot"),
        _kv("Array type", "cupy"),
        _kv("User size", "40000"),
        _kv("Compute shape", "(40000, 40000)"),
        _kv("Compute chunk size", "(10000, 10000)"),
        _kv("Device(s)", "0,1"),
        _kv("Data processed", "23.84 GiB"),
        _kv("RMM Pool", "True"),
        _kv("Protocol", "ucx"),
        _kv("UCX transport selection", "manual"),
        _kv("NVLink", "True"),
        _kv("Worker thread(s)", "1"),
        _kv("Number of workers", "2"),
        "=" * 80,
        _kv("Wall clock", "Throughput"),
        "-" * 80,
        _kv(format_time(1.68), "14.19 GiB/s"),
        _kv(format_time(1.64), "14.54 GiB/s"),
        "=" * 80,
        _kv("Throughput", "14.36 GiB/s +/- 123.21 MiB/s"),
        _kv("Bandwidth", "48.70 GiB/s +/- 3.10 GiB/s"),
        _kv("Wall clock", f"{format_time(1.66)} +/- {format_time(0.02)}"),
        "=" * 80,
        _kv("(w1,w2)", "25% 50% 75% (total nbytes)"),
        "-" * 80,
        _kv("(0,1)", "40.10 GiB/s 48.70 GiB/s 52.00 GiB/s (5.96 GiB)"),
        "=" * 80,
    ]
)


@pytest.mark.parametrize("seconds", [0.00012345, 0.0123, 1.66, 17.1, 123.456, 1234.0, 12345.0])
def test_parse_dask_time_reads_what_format_time_writes(seconds):
    text = format_time(seconds)
    # format_time keeps 2 decimals below 10 min, whole seconds / minutes above.
    assert peers.parse_dask_time(text) == pytest.approx(seconds, rel=0.01, abs=60 if seconds > 7200 else 1)


def test_parse_dask_time_rejects_other_text():
    with pytest.raises(ValueError):
        peers.parse_dask_time("14.19 GiB/s")


def test_parse_local_cupy_text_gets_each_run_and_the_mean():
    parsed = peers.parse_local_cupy_text(LOCAL_CUPY_OUTPUT)
    assert parsed["runs"] == pytest.approx([1.68, 1.64])
    assert parsed["mean"] == pytest.approx(1.66)
    assert parsed["std"] == pytest.approx(0.02)


def test_parse_local_cupy_text_without_a_table_says_so():
    with pytest.raises(ValueError, match="Wall clock"):
        peers.parse_local_cupy_text("Traceback (most recent call last):\n  ...\nRuntimeError: UCX failed")


def test_parse_local_cupy_json_orders_runs_by_index():
    # DataFrame.to_json() (orient="columns") of create_tidy_results' frame, trimmed.
    data = {
        "operation": {"0": "dot", "1": "dot", "10": "dot", "2": "dot"},
        "wallclock": {"0": 1.7, "1": 1.6, "10": 9.0, "2": 1.5},
    }
    assert peers.parse_local_cupy_json(data) == [1.7, 1.6, 1.5, 9.0]


def test_parse_local_cupy_json_from_pandas():
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(
        [
            {"operation": "dot", "wallclock": 1.68, "compute_shape": (40000, 40000)},
            {"operation": "dot", "wallclock": 1.64, "compute_shape": (40000, 40000)},
        ]
    )
    assert peers.parse_local_cupy_json(json.loads(frame.to_json())) == [1.68, 1.64]


def test_local_cupy_step_prefers_json_and_falls_back_to_the_printed_table(tmp_path):
    parse = peers._parse_local_cupy("ucx", 40000, 10000)
    log = tmp_path / "log"
    log.write_text(LOCAL_CUPY_OUTPUT)
    raw = tmp_path / "raw.json"
    fig = parse(raw, log)["figures"][0]
    assert fig["source"] == "printed table" and fig["seconds"] == pytest.approx(1.66)
    assert fig["value"] == pytest.approx(2 * 40000**3 / 1.66 / 1e12)  # TFLOP/s of x.dot(y)
    assert fig["group"] == "local-cupy-dot" and fig["system"] == "local_cupy-ucx"
    raw.write_text(json.dumps({"wallclock": {"0": 2.0, "1": 4.0}}))
    fig = parse(raw, log)["figures"][0]
    assert fig["source"] == "json" and fig["seconds"] == 3.0


def test_build_rows_shares_and_ratios():
    figures = [
        {"group": "matmul-float32", "system": "dask-array-tcp", "label": "tcp", "value": 10.0, "unit": "TFLOP/s"},
        {"group": "matmul-float32", "system": "mgpu", "label": "mgpu", "value": 100.0, "unit": "TFLOP/s"},
        {"group": "matmul-float32", "system": "cupy-1gpu", "label": "1gpu", "value": 50.0, "unit": "TFLOP/s"},
        {"group": "matmul-float32", "system": "mgpu-kernels", "label": "kern", "value": 104.0, "unit": "TFLOP/s"},
        {"group": "dot-float32", "system": "dask-array-ucx", "label": "ucx", "value": 200.0, "unit": "GB/s"},
        {"group": "local-cupy-dot", "system": "local_cupy-tcp", "label": "lc", "value": None, "unit": "TFLOP/s"},
        {"group": "local-cupy-dot", "system": "mgpu", "label": "mgpu", "value": 90.0, "unit": "TFLOP/s"},
    ]
    rows = peers.build_rows(figures, {"gemm_float32": 110.0, "copy": 8000.0})
    by = {(r["group"], r["system"]): r for r in rows}
    assert [r["system"] for r in rows[:4]] == ["mgpu", "mgpu-kernels", "dask-array-tcp", "cupy-1gpu"]
    assert by["matmul-float32", "mgpu-kernels"]["mgpu_ratio"] is None
    assert by["matmul-float32", "mgpu"]["share"] == pytest.approx(100 / 110)
    assert by["matmul-float32", "mgpu"]["mgpu_ratio"] is None
    assert by["matmul-float32", "dask-array-tcp"]["mgpu_ratio"] == pytest.approx(10.0)
    assert by["matmul-float32", "cupy-1gpu"]["mgpu_ratio"] == pytest.approx(2.0)
    assert by["dot-float32", "dask-array-ucx"]["share"] == pytest.approx(0.025)
    assert by["dot-float32", "dask-array-ucx"]["mgpu_ratio"] is None  # no mgpu figure in the group
    assert by["local-cupy-dot", "local_cupy-tcp"]["mgpu_ratio"] is None  # the peer failed
    assert by["local-cupy-dot", "mgpu"]["share"] is None  # no float64 ceiling given
    assert peers.build_rows(figures, None)[0]["share"] is None


def test_summed_ceilings_adds_the_gpus():
    total = peers.summed_ceilings({"0": {"gemm_float32": 54.0, "copy": 4270.0}, "1": {"gemm_float32": 53.0}})
    assert total == {"copy": 4270.0, "gemm_float32": 107.0}
    assert peers.summed_ceilings({}) == {}


@pytest.mark.parametrize("quick", [False, True])
def test_steps_run_the_agreed_commands(tmp_path, quick):
    steps = {s.name: s for s in peers.plan_steps(tmp_path, quick)}
    assert list(steps)[0] == "cupy"
    size, chunk = ("10000", "2500") if quick else ("40000", "10000")
    for protocol in ("tcp", "ucx"):
        cmd = steps[f"local-cupy-{protocol}"].cmd
        assert cmd[1:3] == ["-m", "dask_cuda.benchmarks.local_cupy"]
        i = cmd.index("-o")
        assert cmd[i : i + 8] == ["-o", "dot", "-s", size, "-c", chunk, "-d", "0,1"]
        assert ("--enable-nvlink" in cmd) == ("-p" in cmd) == (protocol == "ucx")
        assert cmd[cmd.index("--output-basename") + 1] == str(steps[f"local-cupy-{protocol}"].raw.with_suffix(""))
        child = steps[f"dask-array-{protocol}"].cmd
        assert child[child.index("--protocol") + 1] == protocol and "--peer" in child
    # Every mgpu step's job file and overrides pass mgpu's own validation.
    mgpu_steps = [s for name, s in steps.items() if name.startswith("mgpu-")]
    assert len(mgpu_steps) == 5
    for step in mgpu_steps:
        cmd = step.cmd
        assert cmd[1:4] == ["-m", "mgpu", "submit"] and cmd[cmd.index("--devices") + 1] == "0,1"
        assert cmd[cmd.index("--json") + 1] == str(step.raw)
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        job = load_job(ROOT / cmd[4], sets)
        assert job.workload in ("matmul", "dot")
    big = load_job(
        ROOT / steps["mgpu-matmul-40k-f64"].cmd[4],
        [
            a
            for i, a in enumerate(steps["mgpu-matmul-40k-f64"].cmd)
            if steps["mgpu-matmul-40k-f64"].cmd[i - 1] == "--set"
        ],
    )
    assert (big.params.m, big.params.n, big.params.k, big.params.dtype) == (int(size),) * 3 + ("float64",)


def _script_step(tmp_path, name: str, code: str, timeout: float = 60) -> peers.Step:
    raw = tmp_path / f"{name}.json"
    return peers.Step(
        name, [sys.executable, "-c", code.replace("RAW", repr(str(raw)))], timeout, peers._parse_child, raw
    )


def test_run_step_records_figures_and_kills_a_step_that_hangs_after_its_output(tmp_path):
    code = (
        "import json, signal; json.dump({'figures': [{'value': 1.0}], 'done': True}, open(RAW, 'w'));"
        "print('wrote', flush=True); signal.pause()"
    )
    rec = peers.run_step(_script_step(tmp_path, "hangs", code), tmp_path, timeout=50, grace=1)
    assert rec["seconds"] < 20
    assert "error" not in rec and rec["figures"] == [{"value": 1.0}]
    assert "did not exit" in rec["note"]
    assert (tmp_path / "hangs.log").read_text() == "wrote\n"


def test_run_step_times_out_and_keeps_partial_figures(tmp_path):
    code = "import json, signal; json.dump({'figures': [{'value': 2.0}], 'done': False}, open(RAW, 'w'));signal.pause()"
    rec = peers.run_step(_script_step(tmp_path, "slow", code), tmp_path, timeout=3, grace=1)
    assert rec["error"].startswith("timed out after 3 s") and rec["rc"] is None
    assert rec["figures"] == [{"value": 2.0}]


def test_run_step_reports_a_crash_and_ignores_stale_output(tmp_path):
    (tmp_path / "crash.json").write_text(json.dumps({"figures": [{"value": 9.9}], "done": True}))
    rec = peers.run_step(_script_step(tmp_path, "crash", "raise SystemExit('UCX could not start')"), tmp_path, 30)
    assert rec["rc"] == 1
    assert "exit status 1: UCX could not start" in rec["error"]
    assert "figures" not in rec and "UCX could not start" in rec["log_tail"]


def test_cli_help_and_unknown_step():
    runner = CliRunner()
    res = runner.invoke(peers.main, ["--help"])
    assert res.exit_code == 0 and "OUTDIR" in res.output and "--quick" in res.output
    res = runner.invoke(peers.main, ["out", "--only", "cupy,nope"])
    assert res.exit_code == 2 and "nope" in res.output and "local-cupy-ucx" in res.output


def test_mgpu_step_reads_a_result(tmp_path):
    # The fields of a float32 matmul result on two GPUs that the step reads, as mgpu writes them.
    result = {
        "status": "ok",
        "wall_s": 3.0,
        "compute_s": 0.68,
        "throughput": {"value": 103.26, "unit": "TFLOP/s", "kernel": 107.16},
        "roofline": {"limit": 102.38, "fraction": 1.0085, "basis": "2 x gemm_float32 measured on one device alone"},
        "verify": {"passed": True, "method": "freivalds", "max_rel_error": 2e-06, "failed_tiles": []},
        "plan": {"tiles": 16, "placement": "static"},
        "env": {"protocol": "tcp"},
    }
    raw = tmp_path / "mgpu.json"
    raw.write_text(json.dumps(result))
    figs = peers._parse_mgpu("matmul-float32", "mgpu matmul")(raw, tmp_path / "log")["figures"]
    assert [f["system"] for f in figs] == ["mgpu", "mgpu-kernels"]
    assert figs[0]["value"] == result["throughput"]["value"] and figs[0]["unit"] == "TFLOP/s"
    assert figs[0]["seconds"] == result["compute_s"] and figs[0]["wall_s"] == result["wall_s"]
    assert figs[0]["roofline"]["fraction"] == result["roofline"]["fraction"] and figs[0]["verify"] is True
    assert figs[1]["value"] == result["throughput"]["kernel"]
