"""Runs -> a tidy table (one row per run), medians with their spread, and the files people
read: CSV, JSON and a markdown report embedding the plots.

Used by ``mgpu scale`` on its own runs and by ``mgpu report`` on any saved results.
Efficiency is throughput at N devices over N/b times the median throughput at the
fewest devices b of the same series (b is 1 in a usual sweep): for strong scaling that is
T_b·b / (T_N·N); for weak scaling, where the work grows with N, it is T_b / T_N.
"""

from __future__ import annotations

import csv
import functools
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .errors import JobInputError
from .results import Result
from .workloads import get_workload_class

__all__ = [
    "BY_FIELDS",
    "ROW_FIELDS",
    "baselines",
    "efficiency",
    "load_rows",
    "row_from_result",
    "size_label",
    "summarize",
    "table_rows",
    "with_efficiency",
    "write_csv",
    "write_json",
    "write_markdown",
    "workers_per_device",
    "write_report",
]

ROW_FIELDS = [
    "job",
    "workload",
    "mode",
    "devices",
    "workers",
    "size",
    "base_size",
    "repeat",
    "status",
    "seconds",
    "expected_s",
    "wall_s",
    "throughput",
    "unit",
    "roofline_fraction",
    "efficiency",
    "backend",
    "allocator",
    "protocol",
    "host",
    "gpu",
    "source",
]
# Row fields that files written before them lack (read as empty).
_LATER_FIELDS = ("source", "expected_s", "workers")
# Fields ``mgpu report --by`` can compare side by side (devices is already the x axis).
BY_FIELDS = ["allocator", "protocol", "host", "gpu", "backend", "workload", "job", "source"]

SCALE_KIND = "mgpu-scale"


def size_label(workload: str, params: Mapping[str, object]) -> str:
    """``"m=4096 n=4096 k=4096"``: a run's size, in the workload's size params."""
    try:
        keys = get_workload_class(workload).size_params
    except KeyError:  # a plugin not installed here: its integer params say enough
        keys = ()
    keys = keys or tuple(k for k, v in params.items() if isinstance(v, int) and not isinstance(v, bool))
    return " ".join(f"{k}={_short(params[k])}" for k in keys if k in params)


def _short(value: object) -> str:
    # 2000000000 reads better as 2e9; 32768 stays as it is.
    if isinstance(value, int) and value >= 10**6:
        digits = str(value).rstrip("0")
        if len(digits) <= 3:
            mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
            return f"{mantissa}e{len(str(value)) - 1}"
    return str(value)


def row_from_result(
    result: Result, *, repeat: int = 0, mode: str = "strong", base_size: str | None = None, source: str = ""
) -> dict[str, Any]:
    """One run's row: the Result's timings and throughput, and what it ran on."""
    size = size_label(result.workload, result.job.get("params", {}))
    cluster = result.job.get("cluster", {})
    return {
        "job": result.job.get("name", result.workload),
        "workload": result.workload,
        "mode": mode,
        # Physical devices, each once; the workers that ran on them (several may share one GPU).
        "devices": len(result.devices),
        "workers": sum(int(d.get("workers", 1)) for d in result.devices),
        "size": size,
        "base_size": base_size if base_size is not None else size,
        "repeat": repeat,
        "status": result.status,
        "seconds": result.compute_s,
        "expected_s": result.estimate.seconds if result.estimate else None,  # what "seconds" was estimated at
        "wall_s": result.wall_s,
        "throughput": result.throughput.value,
        "unit": result.throughput.unit,
        "roofline_fraction": result.roofline.fraction if result.roofline else None,
        "efficiency": None,
        "backend": result.backend,
        "allocator": result.env.get("allocator", cluster.get("allocator", "")),
        "protocol": result.env.get("protocol", cluster.get("protocol", "")),
        "host": ",".join(result.env.get("hosts", [])) or ",".join(sorted({d.get("host", "") for d in result.devices})),
        "gpu": ",".join(result.env.get("gpus", [])),
        "source": source,
    }


def workers_per_device(row: Mapping[str, Any]) -> int:
    """How many workers shared each device in a row's run (1 in rows written before it was recorded)."""
    return max(1, int(row.get("workers") or row["devices"]) // max(1, int(row["devices"])))


def _series(row: Mapping[str, Any], by: list[str]) -> tuple[Any, ...]:
    # Runs whose efficiency shares a baseline: same job and size, same compared fields, and
    # as many workers on each device (more workers on one GPU are not more devices).
    return (row["job"], row["workload"], row["mode"], row["base_size"], workers_per_device(row), *(row[b] for b in by))


def baselines(
    rows: Iterable[Mapping[str, Any]],
    series: Callable[[Mapping[str, Any]], Hashable],
    value: Callable[[Mapping[str, Any]], float | None],
) -> dict[Hashable, tuple[int, float]]:
    """Each series' baseline: its fewest devices with a value, and the median value there.

    A series whose values stand at one device count alone has none: it scales nothing.
    """
    values: dict[Hashable, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        v = value(r)
        if v is not None:
            values[series(r)][int(r["devices"])].append(v)
    return {s: (n := min(at), statistics.median(at[n])) for s, at in values.items() if len(at) > 1}


def efficiency(
    rows: Sequence[Mapping[str, Any]],
    series: Callable[[Mapping[str, Any]], Hashable],
    value: Callable[[Mapping[str, Any]], float | None],
) -> list[float | None]:
    """Each row's efficiency: its value at N devices over N/b times the median value at
    its series' baseline b (:func:`baselines`); None without a value or a baseline."""
    base = baselines(rows, series, value)
    out: list[float | None] = []
    for r in rows:
        v, (b_n, b_value) = value(r), base.get(series(r), (0, 0.0))
        out.append(v / (b_value * r["devices"] / b_n) if v is not None and b_value > 0 else None)
    return out


def _ok_throughput(row: Mapping[str, Any]) -> float | None:
    # A failed run (a wrong answer) counts in no median.
    return row["throughput"] if row["status"] == "ok" else None


def _median_throughput(entry: Mapping[str, Any]) -> float | None:
    return entry["throughput_median"]


def with_efficiency(rows: list[dict[str, Any]], by: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows with ``efficiency`` set against each series' fewest-device median throughput.

    Failed runs (a wrong answer) keep ``efficiency`` None and do not count in any median.
    """
    effs = efficiency(rows, functools.partial(_series, by=by or []), _ok_throughput)
    return [{**r, "efficiency": eff} for r, eff in zip(rows, effs, strict=True)]


def _spread(values: list[float], name: str) -> dict[str, float | None]:
    if not values:
        return {f"{name}_median": None, f"{name}_min": None, f"{name}_max": None}
    return {f"{name}_median": statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}


def summarize(rows: list[dict[str, Any]], by: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per series and device count: run counts, medians and min/max spread.

    ``efficiency`` here is the median throughput at N over N/b times the median at the
    baseline b; ``efficiency_min``/``_max`` are the spread of the runs' own efficiencies.
    """
    by = by or []
    rows = with_efficiency(rows, by)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        key = (*_series(r, by), r["devices"])
        groups[key].append(r)
    summary = []
    for group in groups.values():
        ok = [r for r in group if r["status"] == "ok"]
        first = group[0]
        entry: dict[str, Any] = {
            "job": first["job"],
            "workload": first["workload"],
            "mode": first["mode"],
            "devices": first["devices"],
            "workers": first.get("workers") or first["devices"],
            "size": first["size"],
            "base_size": first["base_size"],
            **{b: first[b] for b in by},
            "runs": len(group),
            "failed": len(group) - len(ok),
            "unit": first["unit"],
        }
        entry.update(_spread([r["seconds"] for r in ok], "seconds"))
        entry.update(_spread([r["throughput"] for r in ok], "throughput"))
        fractions = [r["roofline_fraction"] for r in ok if r["roofline_fraction"] is not None]
        entry["roofline_fraction_median"] = statistics.median(fractions) if fractions else None
        effs = [r["efficiency"] for r in ok if r["efficiency"] is not None]
        entry["efficiency_min"], entry["efficiency_max"] = (min(effs), max(effs)) if effs else (None, None)
        summary.append(entry)
    series = functools.partial(_series, by=by)
    base = baselines(summary, series, _median_throughput)
    for entry, eff in zip(summary, efficiency(summary, series, _median_throughput), strict=True):
        entry["baseline_devices"] = base[series(entry)][0] if series(entry) in base else None
        entry["efficiency"] = eff
    summary.sort(key=lambda e: (e["job"], str(e["base_size"]), *(str(e[b]) for b in by), e["devices"], e["workers"]))
    return summary


# -- reading saved results ---------------------------------------------------------------


def load_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Rows from Result JSON files (``submit --json``: one result, or a list for several
    jobs) and scale JSON files (``scale.json``).

    Results of the same job, size, device count and machine are numbered as repeats.

    Raises
    ------
    JobInputError
        If a file is missing, is not JSON, or is neither kind of file.
    """
    rows: list[dict[str, Any]] = []
    repeats: dict[tuple[Any, ...], int] = defaultdict(int)
    for path in map(Path, paths):
        if not path.is_file():
            raise JobInputError(f"{str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise JobInputError(f"{str(path)!r} is not JSON: {e}") from None
        if isinstance(data, dict) and data.get("kind") == SCALE_KIND and isinstance(data.get("rows"), list):
            for r in data["rows"]:
                if not isinstance(r, dict) or any(k not in r for k in ROW_FIELDS if k not in _LATER_FIELDS):
                    raise JobInputError(
                        f"{str(path)!r}: a row of this scale JSON lacks fields; each needs "
                        f"{', '.join(k for k in ROW_FIELDS if k not in _LATER_FIELDS)}"
                    )
                rows.append({"expected_s": None, "workers": None, **r, "source": r.get("source") or path.name})
            continue
        # submit --json writes one result, or a list of them for several jobs.
        docs = data if isinstance(data, list) and data else [data]
        for i, doc in enumerate(docs):
            try:
                result = Result.model_validate(doc)
            except ValidationError:
                which = f" (item {i + 1} of its list)" if len(docs) > 1 else ""
                raise JobInputError(
                    f"{str(path)!r}{which} is not an mgpu result: expected the JSON of "
                    "'mgpu submit --json' (one result or a list of them) or the scale.json of 'mgpu scale'"
                ) from None
            row = row_from_result(result, source=path.name)
            key = (
                row["job"],
                row["size"],
                row["devices"],
                row["workers"],
                row["host"],
                row["allocator"],
                row["protocol"],
            )
            row["repeat"], repeats[key] = repeats[key], repeats[key] + 1
            rows.append(row)
    return rows


# -- writing ---------------------------------------------------------------------------


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """The tidy table: one row per run, the columns of ``ROW_FIELDS``."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in ROW_FIELDS})
    return path


def write_json(path: Path, rows: list[dict[str, Any]], summary: list[dict[str, Any]], **meta: Any) -> Path:
    """Rows, summary and what produced them, readable again by ``mgpu report``."""
    doc = {"kind": SCALE_KIND, "version": 1, **meta, "rows": rows, "summary": summary}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def table_rows(summary: list[dict[str, Any]], by: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """The summary as text cells, each figure "median (min–max)", for markdown and console."""
    by = by or []
    jobs = len({e["job"] for e in summary}) > 1
    units = {e["unit"] for e in summary}
    unit = f" ({units.pop()})" if len(units) == 1 else ""
    header = [
        *(["job"] if jobs else []),
        *by,
        "devices",
        "size",
        "runs",
        "seconds",
        f"throughput{unit}",
        "efficiency",
        "of limit",
    ]
    cells = []
    for e in summary:
        failed = f" ({e['failed']} failed)" if e["failed"] else ""
        cells.append(
            [
                *([e["job"]] if jobs else []),
                *(str(e[b]) for b in by),
                str(e["devices"]) + (f" ({e['workers']} workers)" if e["workers"] != e["devices"] else ""),
                e["size"],
                f"{e['runs']}{failed}",
                f"{_fmt(e['seconds_median'])} ({_fmt(e['seconds_min'])}–{_fmt(e['seconds_max'])})",
                f"{_fmt(e['throughput_median'])} ({_fmt(e['throughput_min'])}–{_fmt(e['throughput_max'])})"
                + ("" if unit else f" {e['unit']}"),
                "–"
                if e["efficiency"] is None
                else f"{_pct(e['efficiency'])} ({_pct(e['efficiency_min'])}–{_pct(e['efficiency_max'])})",
                _pct(e["roofline_fraction_median"]),
            ]
        )
    return header, cells


def write_markdown(
    path: Path,
    summary: list[dict[str, Any]],
    *,
    title: str,
    lines: list[str],
    plots: dict[str, Path | None],
    by: list[str] | None = None,
) -> Path:
    """A short report: what ran, the plots, the median/spread table and how to read it."""
    header, cells = table_rows(summary, by)
    out = [f"# {title}", "", *lines, ""]
    for caption, plot in plots.items():
        if plot is not None:
            out += [f"![{caption}]({plot.name})", ""]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    baselines = sorted({e["baseline_devices"] for e in summary if e["baseline_devices"]})
    base = " and ".join(str(b) for b in baselines) or "the fewest"
    out += [
        "",
        "Each figure is the median of the runs, with their spread (min–max) in brackets. "
        f"Efficiency is the median throughput at N devices over N/b times the median at b = {base} "
        "device(s): the share of perfect scaling. Seconds are compute time (cluster start-up excluded); "
        "'of limit' is the median share of the hardware limit, the sum of each device's measured ceiling.",
        "",
    ]
    path.write_text("\n".join(out))
    return path


def write_report(
    out_dir: Path, rows: list[dict[str, Any]], *, title: str, lines: list[str], by: list[str] | None = None, **meta: Any
) -> dict[str, Path]:
    """Every file of a report in ``out_dir``: CSV, JSON, the PNGs and REPORT.md."""
    from .plots import efficiency_plot, throughput_plot

    by = by or []
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = with_efficiency(rows, by)
    summary = summarize(rows, by)
    stem = "scale" if meta.get("command") == "scale" else "report"
    files = {
        "csv": write_csv(rows, out_dir / f"{stem}.csv"),
        "json": write_json(out_dir / f"{stem}.json", rows, summary, by=by, **meta),
    }
    plots = {
        "Throughput against devices": throughput_plot(summary, out_dir / "throughput.png", by=by, title=title),
        "Efficiency against devices": efficiency_plot(summary, out_dir / "efficiency.png", by=by, title=title),
    }
    files.update({p.stem: p for p in plots.values() if p is not None})
    files["report"] = write_markdown(out_dir / "REPORT.md", summary, title=title, lines=lines, plots=plots, by=by)
    return files
