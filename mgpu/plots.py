"""Summary rows -> PNG plots: throughput against devices (with the ideal line) and efficiency.

Drawn with matplotlib's object API on the Agg canvas: no pyplot state, no display needed.
One panel per workload (each has its own unit); one line per series (a size, a job, or a
value of ``mgpu report --by``). Points are medians; bars span min to max.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["efficiency_plot", "throughput_plot"]

_PANEL_W, _PANEL_H, _DPI = 6.0, 4.2, 110


def _series_fields(summary: list[dict[str, Any]], by: list[str]) -> list[str]:
    # Name a series only by what differs: a lone job or size needs no label.
    fields = [f for f in ("job", "base_size") if len({e[f] for e in summary}) > 1]
    return fields + [b for b in by if b not in fields]


def _panels(summary: list[dict[str, Any]], by: list[str]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """workload -> series label -> entries sorted by devices."""
    fields = _series_fields(summary, by)
    panels: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in summary:
        if e["throughput_median"] is None:
            continue
        label = ", ".join(f"{e[f]}" if f in ("job", "base_size") else f"{f} {e[f]}" for f in fields) or e["job"]
        panels[e["workload"]][label].append(e)
    for series in panels.values():
        for entries in series.values():
            entries.sort(key=lambda e: e["devices"])
    return panels


def _new_figure(n_panels: int) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(_PANEL_W * n_panels, _PANEL_H), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n_panels, squeeze=False)[0]
    return fig, list(axes)


def _errors(entries: list[dict[str, Any]], name: str, scale: float = 1.0) -> list[list[float]]:
    med = [e[f"{name}_median" if name != "efficiency" else name] * scale for e in entries]
    lo = [e[f"{name}_min"] * scale if e[f"{name}_min"] is not None else m for e, m in zip(entries, med, strict=True)]
    hi = [e[f"{name}_max"] * scale if e[f"{name}_max"] is not None else m for e, m in zip(entries, med, strict=True)]
    return [
        [max(0.0, m - a) for m, a in zip(med, lo, strict=True)],
        [max(0.0, b - m) for m, b in zip(med, hi, strict=True)],
    ]


def throughput_plot(
    summary: list[dict[str, Any]], path: Path, *, by: list[str] | None = None, title: str = ""
) -> Path | None:
    """Median throughput against devices, min–max bars, and the ideal (perfect scaling) line.

    Where every series ran on one device count only (comparing allocators, say), the
    series are drawn as bars side by side instead.
    """
    panels = _panels(summary, by or [])
    if not panels:
        return None
    fig, axes = _new_figure(len(panels))
    for ax, (workload, series) in zip(axes, sorted(panels.items()), strict=True):
        unit = next(iter(series.values()))[0]["unit"]
        counts = sorted({e["devices"] for entries in series.values() for e in entries})
        if len(counts) == 1:
            labels = list(series)
            med = [series[s][0]["throughput_median"] for s in labels]
            err = [_errors(series[s], "throughput") for s in labels]
            ax.bar(
                range(len(labels)),
                med,
                yerr=[[e[0][0] for e in err], [e[1][0] for e in err]],
                capsize=6,
                color=[f"C{i}" for i in range(len(labels))],
            )
            ax.set_xticks(range(len(labels)), labels, rotation=15 if len(labels) > 3 else 0)
            ax.set_xlabel(f"{counts[0]} device{'s' * (counts[0] != 1)}")
        else:
            for i, (label, entries) in enumerate(series.items()):
                x = [e["devices"] for e in entries]
                ax.errorbar(
                    x,
                    [e["throughput_median"] for e in entries],
                    yerr=_errors(entries, "throughput"),
                    marker="o",
                    capsize=4,
                    color=f"C{i}",
                    label=label,
                )
                if len(x) < 2:
                    continue
                b_n, b_thr = entries[0]["devices"], entries[0]["throughput_median"]
                ax.plot(
                    x,
                    [b_thr * n / b_n for n in x],
                    linestyle="--",
                    color=f"C{i}",
                    alpha=0.6,
                    label="ideal" if len(series) == 1 else f"ideal ({label})",
                )
            ax.set_xticks(counts)
            ax.set_xlabel("devices")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize="small")
        ax.set_ylabel(f"throughput ({unit})")
        ax.set_title(workload)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path)
    return path


def efficiency_plot(
    summary: list[dict[str, Any]], path: Path, *, by: list[str] | None = None, title: str = ""
) -> Path | None:
    """Scaling efficiency (%) against devices, min–max bars; None where no series has two counts."""
    panels = {
        w: {s: e for s, e in series.items() if len(e) > 1 and all(x["efficiency"] is not None for x in e)}
        for w, series in _panels(summary, by or []).items()
    }
    panels = {w: s for w, s in panels.items() if s}
    if not panels:
        return None
    fig, axes = _new_figure(len(panels))
    for ax, (workload, series) in zip(axes, sorted(panels.items()), strict=True):
        counts = sorted({e["devices"] for entries in series.values() for e in entries})
        for i, (label, entries) in enumerate(series.items()):
            ax.errorbar(
                [e["devices"] for e in entries],
                [e["efficiency"] * 100 for e in entries],
                yerr=_errors(entries, "efficiency", 100.0),
                marker="o",
                capsize=4,
                color=f"C{i}",
                label=label,
            )
        ax.axhline(100, linestyle="--", color="grey", label="ideal")
        ax.set_xticks(counts)
        ax.set_xlabel("devices")
        ax.set_ylabel("efficiency (%)")
        ax.set_ylim(
            bottom=0,
            top=max(
                110, *(e["efficiency_max"] * 105 for s in series.values() for e in s if e["efficiency_max"] is not None)
            ),
        )
        ax.set_title(workload)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(path)
    return path
