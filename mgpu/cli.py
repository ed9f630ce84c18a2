"""``python -m mgpu submit|info``: the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__
from .errors import JobFailed, JobInputError
from .results import print_result
from .runner import Events, run_jobs
from .security import client_security
from .signals import Interrupted, cancel_on_signals
from .spec import load_job

__all__ = ["main"]

_CONTEXT = {"help_option_names": ["-h", "--help"]}


class _Reporter(Events):
    """Says what started where, and draws the tile progress bar on a terminal."""

    def __init__(self, console: Console, show_progress: bool, files: list[Path] | None = None) -> None:
        self.console = console
        self.show_progress = show_progress
        self.progress: Progress | None = None
        self.task: Any = None
        self.files = files or []
        self.results: list[Any] = []

    def cluster_ready(self, info: Any) -> None:
        n = len(info.devices)
        if info.backend == "cpu":
            where = f"{n} CPU worker{'s' * (n != 1)} with NumPy"
            where += " (joined cluster)" if not info.owned else f" ({info.resolved.why})"
        else:
            names = sorted({f.name for f in info.devices.values()})
            where = f"{n} GPU worker{'s' * (n != 1)} ({', '.join(names)}), allocator {info.resolved.allocator}"
        self.console.print(f"mgpu: running on {where}")
        if info.dashboard_link:
            self.console.print(f"mgpu: dashboard {info.dashboard_link}")

    def planned(self, plan: Any) -> None:
        self.console.print(f"mgpu: plan: {plan.describe()}")
        if self.show_progress:
            self.progress = Progress(
                TextColumn("tiles"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                console=self.console, transient=True,
            )
            self.task = self.progress.add_task("tiles", total=len(plan.tiles), rate="")
            self.progress.start()

    def tile_done(self, record: Any) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def worker_lost(self, worker: str, tiles: list[int]) -> None:
        self.console.print(f"mgpu: lost worker {worker}; recomputing its tile(s) {tiles[:20]} on the others",
                           soft_wrap=True)

    def job_started(self, index: int, job: Any) -> None:
        if len(self.files) > 1:
            self.console.print(f"mgpu: job {index + 1} of {len(self.files)}: {job.name} ({self.files[index]})",
                               soft_wrap=True)

    def job_done(self, result: Any) -> None:
        self.close()
        self.results.append(result)
        print_result(result, self.console)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _devices_override(value: str) -> str:
    value = value.strip()
    if value == "all" or value.isdigit():
        return value
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise click.BadParameter("expected all, a count (2) or device ids (0,1)", param_hint="--devices")
    return "[" + ",".join(parts) + "]"


@click.group(context_settings=_CONTEXT)
@click.version_option(__version__, "--version", prog_name="mgpu")
def cli() -> None:
    """mgpu: run large array jobs on every GPU of a node (or CPU workers) with Dask."""


@cli.command(context_settings=_CONTEXT)
@click.argument("job_files", metavar="JOB_FILE...", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--devices", help="all, a count (2) or device ids (0,1); overrides cluster.devices")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), help="overrides cluster.backend")
@click.option("--allocator", type=click.Choice(["pool", "async", "managed", "default"]),
              help="overrides cluster.allocator")
@click.option("--scheduler", metavar="ADDR", help="join a running cluster (address or scheduler file)")
@click.option("--scheduler-file", metavar="PATH", type=click.Path(exists=True, dir_okay=False),
              help="join the running cluster whose scheduler wrote PATH (dask scheduler --scheduler-file)")
@click.option("--tls-ca-file", metavar="PEM", help="CA certificate(s) for a TLS scheduler (tls://)")
@click.option("--tls-cert", metavar="PEM", help="this client's certificate for a TLS scheduler")
@click.option("--tls-key", metavar="PEM", help="this client's private key (unless it is in --tls-cert)")
@click.option("--dashboard", metavar="ADDR", help="dashboard address (default 127.0.0.1:8787)")
@click.option("--no-dashboard", is_flag=True, help="start no dashboard")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a job key, e.g. params.m=4096")
@click.option("--json", "json_path", metavar="PATH",
              help="write the result as JSON (- for stdout); a list of results for several jobs")
@click.option("--no-verify", is_flag=True, help="skip checking the tiles")
@click.option("--force", is_flag=True, help="replace output files that already exist")
@click.option("--quiet", "-q", is_flag=True, help="no progress bar and no table")
def submit(job_files: tuple[Path, ...], devices: str | None, backend: str | None, allocator: str | None,
           scheduler: str | None, scheduler_file: str | None, tls_ca_file: str | None, tls_cert: str | None,
           tls_key: str | None, dashboard: str | None, no_dashboard: bool, sets: tuple[str, ...],
           json_path: str | None, no_verify: bool, force: bool, quiet: bool) -> None:
    """Run job files, one after another on one cluster, and report each."""
    if scheduler and scheduler_file:
        raise click.UsageError("give --scheduler or --scheduler-file, not both")
    scheduler = scheduler or (str(Path(scheduler_file).resolve()) if scheduler_file else None)
    overrides = list(sets)
    if devices is not None:
        overrides.append(f"cluster.devices={_devices_override(devices)}")
    for key, value in (("backend", backend), ("allocator", allocator), ("scheduler", scheduler),
                       ("dashboard", dashboard)):
        if value is not None:
            overrides.append(f"cluster.{key}={value}")
    if no_dashboard:
        overrides.append("cluster.dashboard=null")
    if no_verify:
        overrides.append("verify=false")
    if force:
        overrides.append("force=true")

    # With JSON on stdout, everything meant for a person goes to stderr.
    console = Console(stderr=json_path == "-" or quiet, quiet=quiet)
    reporter = _Reporter(console, show_progress=not quiet and console.is_terminal and json_path != "-",
                         files=list(job_files))
    not_run = ""
    try:
        jobs = [load_job(f, overrides) for f in job_files]
        if json_path and json_path != "-" and not Path(json_path).expanduser().parent.is_dir():
            raise JobInputError(f"--json: the folder of {json_path!r} does not exist")
        security = client_security(tls_ca_file, tls_cert, tls_key)
        try:
            with cancel_on_signals():
                run_jobs(jobs, reporter, security=security)
        finally:
            reporter.close()
            _write_json(reporter.results, json_path, several=len(job_files) > 1)
            left = len(job_files) - len(reporter.results)
            not_run = f"; {left} later job(s) not run" if len(job_files) > 1 and left else ""
    except JobInputError as e:
        _fail(str(e), JobInputError.exit_code)
    except JobFailed as e:
        _fail(f"job failed: {e}{not_run}", JobFailed.exit_code)
    except Interrupted as e:
        if len(reporter.results) == len(job_files):
            _fail(f"interrupted ({e}) while closing the cluster; every job had finished", e.exit_code)
        _fail(f"interrupted ({e}); the job's tasks were cancelled, the cluster mgpu started was closed, "
              f"and no partial output was kept{not_run}", e.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted; the cluster was closed and no output was kept", 130)

    if reporter.results[-1].status != "ok":
        _fail(f"verification failed: the result is wrong{not_run}", JobFailed.exit_code)


def _write_json(results: list[Any], json_path: str | None, *, several: bool) -> None:
    """One object for one job; a list, in submission order, for several (those that ran)."""
    if not json_path or not results:
        return
    if several:
        text = json.dumps([r.model_dump(mode="json") for r in results], indent=2)
    else:
        text = results[0].model_dump_json(indent=2)
    if json_path == "-":
        click.echo(text)
    else:
        Path(json_path).expanduser().write_text(text + "\n")


@cli.command(context_settings=_CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="print the facts as JSON")
@click.option("--calibrate", is_flag=True, help="measure each device's ceilings (GEMM, copy, Mandelbrot) anew")
def info(as_json: bool, calibrate: bool) -> None:
    """List the GPUs, their links, versions, allocators and transports."""
    from .info import machine_info

    facts = machine_info()
    if calibrate:
        facts["ceilings"] = _calibrate()
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    console = Console()
    console.print(f"host {facts['host']}, {facts['cpus']} CPUs, backend [bold]{facts['backend']}[/bold]")
    if facts["backend"] == "cpu":
        console.print(facts["note"])
    else:
        console.print(f"CUDA driver {facts['driver']}, runtime {facts['runtime']}")
        for g in facts["gpus"]:
            links = facts["nvlink"].get(str(g["id"]))
            nvl = f", {links} NVLink links active" if links else ""
            console.print(f"  GPU {g['id']}: {g['name']}, {g['memory'] / 2**30:.1f} GiB, "
                          f"compute capability {g['compute_capability']}{nvl}")
        pairs = ", ".join(f"{a}->{b}" for a, b in facts["peer_access"]) or "none"
        console.print(f"peer access: {pairs}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in facts["versions"].items()))
    console.print(f"allocators: {', '.join(facts['allocators'])}; UCX: {'yes' if facts['ucx'] else 'no'}")
    for dev, rates in facts.get("ceilings", {}).items():
        console.print(f"ceilings of {dev}: " + ", ".join(
            f"{k} {v:.4g} {_CEILING_UNITS[k.split('_')[0]]}" for k, v in sorted(rates.items())))


_CEILING_UNITS = {"gemm": "TFLOP/s", "copy": "GB/s", "mandelbrot": "Giter/s"}


def _calibrate() -> dict[str, dict[str, float]]:
    """Start a cluster on every device, measure each alone, and refresh the cache."""
    from .cluster import open_cluster, resolve_cluster
    from .roofline import ceilings_for
    from .spec import ClusterSpec

    with open_cluster(resolve_cluster(ClusterSpec(dashboard=None))) as cluster:
        rates = ceilings_for(cluster.client, cluster.devices, refresh=True)
        return {f"{f.host}:{f.backend}{f.id}": rates[addr] for addr, f in cluster.devices.items()}


def _fail(message: str, code: int) -> None:
    click.echo(f"mgpu: error: {message}" if code == 2 else f"mgpu: {message}", err=True)
    sys.exit(code)


def main() -> None:
    """Entry point of ``mgpu`` and ``python -m mgpu``."""
    cli(prog_name="mgpu")
