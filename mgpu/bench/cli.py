"""``mgpu bench SUITE [options]``: one command per suite, the same options for each."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..errors import JobInputError
from ..spec import MAX_WORKERS_PER_DEVICE
from . import alloc, latency, outofcore, peers, scale, suite
from .harness import BenchInputError, Options, check_out, parse_devices, say, write_record

__all__ = ["bench"]

_CONTEXT = {"help_option_names": ["-h", "--help"]}
_PRESETS = click.Choice(["auto", "tiny", "small", "full"])


@click.group(context_settings=_CONTEXT)
def bench() -> None:
    """Benchmark suites; each writes OUT/SUITE.json (see docs/performance.md)."""


def _devices(ctx: click.Context, param: click.Parameter, value: str) -> list[int] | None:
    try:
        return parse_devices(value)
    except BenchInputError as e:
        raise click.BadParameter(str(e).split(": ", 1)[1]) from None


def _shared(fn: Callable[..., Any], *, devices: bool = True, sizes: click.ParamType = _PRESETS) -> Callable[..., Any]:
    """The options every suite takes (``--devices`` and ``--protocol`` where they apply)."""
    options = [
        click.option(
            "--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="folder for SUITE.json"
        ),
        click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"])),
        click.option(
            "--sizes",
            default="auto",
            show_default=True,
            type=sizes,
            help="size preset (auto: full on GPUs, tiny on CPU)",
        ),
        click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1), help="runs of each job"),
        click.option("--force", is_flag=True, help="replace a record already in --out"),
    ]
    if devices:
        options += [
            click.option(
                "--devices", default="all", show_default=True, callback=_devices, help="device counts: all, 2, or 1,2,4"
            ),
            click.option("--protocol", default="auto", show_default=True, type=click.Choice(["auto", "tcp", "ucx"])),
            click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a key of every mgpu job"),
        ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _command(name: str, params: dict[str, Any]) -> list[str]:
    """The command that reruns this suite with every option written out."""
    cmd = ["mgpu", "bench", name]
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        if key == "devices" and not isinstance(value, int):
            cmd += [flag, "all" if value is None else ",".join(map(str, value))]
        elif key in ("sets", "jobs"):  # repeatable: --set KEY=VALUE, --job FILE
            for s in value:
                cmd += ["--" + key[:-1], s]
        elif isinstance(value, bool):
            cmd += [flag] if value else []
        elif isinstance(value, list):
            cmd += [flag, ",".join(map(str, value))]
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def _run(name: str, module: ModuleType, params: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    shared: dict[str, Any] = {
        k: params.pop(k)
        for k in ("out", "backend", "sizes", "repeats", "force", "devices", "protocol", "sets")
        if k in params
    }
    opts = Options(
        suite=name,
        out=shared["out"],
        backend=shared["backend"],
        devices=shared.get("devices"),
        sizes=shared["sizes"],
        repeats=shared["repeats"],
        protocol=shared.get("protocol", "auto"),
        sets=list(shared.get("sets", ())),
        force=shared["force"],
        extra=extra or {},
        command=_command(name, {**shared, **(extra or {})}),
    )
    started = time.perf_counter()
    try:
        check_out(opts)
        resolved, body = module.run(opts)
    except (BenchInputError, JobInputError) as e:
        click.echo(f"mgpu: error: {e}", err=True)
        sys.exit(2)
    path = write_record(opts, started, resolved, body)
    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = 120  # a log keeps whole names, not a terminal's wrapping
    _print_summary(body, console)
    say(f"wrote {path} ({shlex.join(opts.command)})")


def _print_summary(body: dict[str, Any], console: Console) -> None:
    rows = body.get("summary") or []
    if rows and "script_s" in rows[0]:
        _print_latency(rows, console)
    elif rows:
        table = Table("job", "devices", "throughput", "share of roofline", "efficiency", "took / expected", "runs ok")
        for r in rows:
            thr = f"{r['throughput']:.4g} {r['unit']}" if r["throughput"] is not None else "failed"
            share = f"{r['roofline_fraction']:.1%}" if r.get("roofline_fraction") else "n/a"
            eff = f"{r['efficiency']:.0%}" if r.get("efficiency") else ""
            took = f"{r['measured_over_expected']:.2f}x" if r.get("measured_over_expected") else ""
            workers = r.get("workers_per_device", 1)
            devices = str(r["devices"]) + (f" ({workers} workers each)" if workers > 1 else "")
            table.add_row(r["name"], devices, thr, share, eff, took, f"{r['ok']}/{r['runs']}")
        console.print(table)
    for row in body.get("comparison") or []:
        console.print(
            f"{row['job']} on {row['devices']}: mgpu {row['mgpu_over_alternative']:.3g}x {row['alternative']} "
            f"({row['value']:.4g} {row['unit']} on {row['alternative_devices']})"
        )
    for name, alt in (body.get("alternatives") or {}).items():
        statuses = {alt["status"]} if "status" in alt else {a.get("status") for a in alt.values()}
        for status in sorted(s for s in statuses if s and s != "ok"):
            console.print(f"{name}: {status}")
    if "alloc" in body and body["alloc"].get("status", "").startswith("skipped"):
        console.print(f"alloc: {body['alloc']['status']}")


def _print_latency(rows: list[dict[str, Any]], console: Console) -> None:
    def s(v: float | None, scale: float = 1.0, fmt: str = ".3g") -> str:
        return "" if v is None else format(v * scale, fmt)

    table = Table(
        "job", "first s", "cold s", "running s", "script s", "running / script", "cold / script",
        "wall s", "compute s", "overhead ms", "client s", "check share",
    )  # fmt: skip
    for r in rows:
        table.add_row(
            r["name"], s(r["first_s"]), s(r["cold_s"]), s(r["running_s"]), s(r["script_s"]),
            s(r["running_over_script"], fmt=".2f"), s(r["cold_over_script"], fmt=".2f"), s(r["wall_s"]),
            s(r["compute_s"]), s(r["overhead_s"], 1e3), s(r["client_s"]), s(r["verify_share"], fmt=".1%"),
        )  # fmt: skip
    console.print(table)
    for r in rows:  # where a running cluster's wall_s went (medians), and the warm-ups sent
        split = ", ".join(f"{k[:-2].replace('_', ' ')} {v * 1e3:.3g}" for k, v in r.get("startup_s", {}).items() if v)
        if split:
            console.print(f"{r['name']} on the running cluster, ms: {split}; warm-ups sent {r.get('warmups')}")


@bench.command("suite", context_settings=_CONTEXT)
@_shared
@click.option("--cached-ceilings", is_flag=True, help="use the cached device ceilings instead of measuring them anew")
@click.option(
    "--job", "jobs", multiple=True, metavar="FILE", help="also run this job file at its own size (repeatable)"
)
def suite_command(cached_ceilings: bool, jobs: tuple[str, ...], **params: Any) -> None:
    """mgpu's device-resident jobs (matmul, dot, Mandelbrot) against their roofline."""
    _run("suite", suite, params, {"cached_ceilings": cached_ceilings, "jobs": list(jobs)})


@bench.command("outofcore", context_settings=_CONTEXT)
@_shared
@click.option(
    "--scratch",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="folder for the input files (default /dev/shm)",
)
def outofcore_command(scratch: Path | None, **params: Any) -> None:
    """Matmul and dot from .npy files larger than the devices' budget, beside cuBLASXt."""
    _run("outofcore", outofcore, params, {"scratch": str(scratch) if scratch else None})


@bench.command("scale", context_settings=_CONTEXT)
@_shared
@click.option(
    "--workers-per-device",
    default=1,
    show_default=True,
    type=click.IntRange(min=1, max=MAX_WORKERS_PER_DEVICE),
    help="also run 2, 4, ... up to this many workers sharing each GPU (compute_s and per-job overhead per count)",
)
@click.option(
    "--job", "jobs", multiple=True, metavar="FILE", help="also run this job file at its own size (repeatable)"
)
def scale_command(workers_per_device: int, jobs: tuple[str, ...], **params: Any) -> None:
    """Each job on 1, 2, 4, ... devices (and workers per GPU): throughput and efficiency."""
    _run("scale", scale, params, {"workers_per_device": workers_per_device, "jobs": list(jobs)})


@bench.command("alloc", context_settings=_CONTEXT)
@lambda fn: _shared(fn, devices=False, sizes=click.STRING)
@click.option("--device", default=0, show_default=True, type=click.IntRange(min=0), help="the GPU to measure")
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1), help="cycles per timed repeat")
def alloc_command(device: int, iterations: int, **params: Any) -> None:
    """Allocate + use + free on one GPU: cudaMalloc, RMM pool, cudaMallocAsync, managed, spill fallback."""
    _run("alloc", alloc, params, {"device": device, "iterations": iterations})


@bench.command("peers", context_settings=_CONTEXT)
@_shared
def peers_command(**params: Any) -> None:
    """mgpu beside dask.array (+ dask-cuda), CuPy on one GPU and cuBLASXt, in one run."""
    _run("peers", peers, params)


def _workloads(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    known = list(latency.SIZES["tiny"])
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise click.BadParameter(f"expected some of {','.join(known)}, got {value!r}")
    return names


@bench.command("latency", context_settings=_CONTEXT)
@lambda fn: _shared(fn, devices=False)
@click.option("--devices", default=1, show_default=True, type=click.IntRange(min=1), help="devices mgpu's jobs run on")
@click.option(
    "--workloads",
    default="matmul,dot,mandelbrot",
    show_default=True,
    callback=_workloads,
    help="the jobs to time (comma-separated)",
)
def latency_command(devices: int, workloads: list[str], **params: Any) -> None:
    """What a user waits for each job (cold, on a running cluster) beside a plain CuPy/NumPy script."""
    _run("latency", latency, params, {"devices": devices, "workloads": workloads})
