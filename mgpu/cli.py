"""``python -m mgpu submit|scale|report|info|bench``: the command line."""

from __future__ import annotations

import importlib
import importlib.util
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from . import __version__
from .client.watch import Events
from .errors import JobFailed, JobInputError
from .lifetime import end, finish, is_command, resume_collection
from .memory import AllocatorChoice
from .paths import check_folder, write_text
from .security import client_security
from .signals import Interrupted, cancel_on_signals
from .spec import load_job

if TYPE_CHECKING:
    from rich.progress import Progress  # imported where a bar is drawn

__all__ = ["main"]

_CONTEXT = {"help_option_names": ["-h", "--help"]}


class _Reporter(Events):
    """Says what started where, and draws the tile progress bar on a terminal."""

    def __init__(self, console: Console, show_progress: bool, files: list[Path] | None = None) -> None:
        self.console = console
        self.show_progress = show_progress
        self.progress: Progress | None = None
        self.task: Any = None
        self.keep_open = False  # submit --keep-open: wait in finished() until Ctrl-C
        self.started = 0.0
        self.files = files or []
        self.results: list[Any] = []

    def cluster_ready(self, info: Any) -> None:
        resume_collection()  # the client's imports and the cluster's start are done
        if self.console.quiet:  # rendered, a line would cost the job's wall time for nothing
            _tell_dashboard(self.console, info)  # (its warnings are printed all the same)
            return
        n = len(info.devices)
        if info.backend == "cpu":
            where = f"{n} CPU worker{'s' * (n != 1)} with NumPy"
            where += " (joined cluster)" if not info.owned else f" ({info.resolved.why})"
        else:
            names = sorted({f.name for f in info.devices.values()})
            gpus = len({f.physical for f in info.devices.values()})
            shared = f" on {gpus} GPU{'s' * (gpus != 1)}" if gpus != n else ""
            where = f"{n} GPU worker{'s' * (n != 1)}{shared} ({', '.join(names)}), allocator {info.resolved.allocator}"
        self.console.print(f"mgpu: running on {where}")
        _tell_dashboard(self.console, info)

    def planned(self, plan: Any) -> None:
        if self.console.quiet:
            return
        self.console.print(f"mgpu: plan: {plan.describe()}")
        expected = plan.notes.get("estimate")
        if expected:
            from .client.estimate import Estimate

            self.console.print(f"mgpu: {Estimate(**expected).describe()}", soft_wrap=True)
        self.start_bar(len(plan.tiles))

    def start_bar(self, total: int) -> None:
        if self.show_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("tiles"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("tiles", total=total, rate="")
            self.started = time.perf_counter()
            self.progress.start()

    def tile_done(self, record: Any) -> None:
        if self.progress is not None:
            done = self.progress.tasks[0].completed + 1
            elapsed = time.perf_counter() - self.started
            self.progress.update(self.task, advance=1, rate=f"{done / elapsed:.3g} tiles/s" if elapsed > 0 else "")

    def finished(self, info: Any, result: Any) -> None:
        self.close()
        if not self.keep_open:
            return
        link = info.dashboard_link or "off"
        message = f"mgpu: cluster kept open at {info.client.scheduler.address}, dashboard {link}; press Ctrl-C to close"
        if self.console.quiet:
            click.echo(message, err=True)
        else:
            self.console.print(message, soft_wrap=True)
        _wait_for_interrupt()

    def worker_lost(self, worker: str, tiles: list[int], step: int | None = None) -> None:
        again = "" if step is None else f", every tile stepping again from step {step}"
        self.console.print(
            f"mgpu: lost worker {worker}; recomputing its tile(s) {tiles[:20]} on the others{again}", soft_wrap=True
        )

    def job_started(self, index: int, job: Any) -> None:
        if len(self.files) > 1:
            self.console.print(
                f"mgpu: job {index + 1} of {len(self.files)}: {job.name} ({self.files[index]})", soft_wrap=True
            )

    def job_done(self, result: Any) -> None:
        self.close()
        self.results.append(result)
        if not self.console.quiet:  # the table's modules are imported for it alone
            from .show import print_result

            print_result(result, self.console)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _tell_dashboard(console: Console, info: Any, note: str = "") -> None:
    """The dashboard's link, the address it is bound to, and a warning where that is not this machine alone."""
    from .cluster import is_loopback

    bound = info.dashboard_address
    if bound is None:
        if not console.quiet and info.dashboard_link:  # a joined cluster's: the scheduler is asked
            console.print(f"mgpu: dashboard {info.dashboard_link}{note}", soft_wrap=True)
        return
    address, link = bound
    console.print(f"mgpu: dashboard {link}, listening on {address}{note}", soft_wrap=True)
    if not is_loopback(address.rpartition(":")[0]):
        click.echo(
            f"mgpu: warning: the dashboard listens on {address}, beyond this machine: anyone who can reach this "
            "host can see it (the jobs, their workers and logs); leave --dashboard out to keep it on 127.0.0.1",
            err=True,
        )


def _overrides(sets: tuple[str, ...], *, no_dashboard: bool, no_verify: bool, **cluster: str | None) -> list[str]:
    """The --set overrides plus those the flags shared by submit and scale stand for."""
    overrides = list(sets)
    overrides += [f"cluster.{key}={value}" for key, value in cluster.items() if value is not None]
    if no_dashboard:
        overrides.append("cluster.dashboard=null")
    if no_verify:
        overrides.append("verify=false")
    return overrides


def _devices_override(value: str) -> str:
    value = value.strip()
    if value == "all" or value.isdigit():
        return value
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise click.BadParameter("expected all, a count (2) or device ids (0,1)", param_hint="--devices")
    return "[" + ",".join(parts) + "]"


# Commands whose modules load only when they run (or their help is asked for): the
# benchmark harness is no part of a job's start-up.
_ON_DEMAND = {"bench": "mgpu.bench.cli:bench", "cluster": "mgpu.cluster_cli:cluster"}


class _Commands(click.Group):
    """mgpu's commands, with those of :data:`_ON_DEMAND` imported when named."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_ON_DEMAND})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _ON_DEMAND:
            module, _, attr = _ON_DEMAND[cmd_name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Commands, context_settings=_CONTEXT)
@click.version_option(__version__, "--version", prog_name="mgpu")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """mgpu: run large array jobs on every GPU of a node (or CPU workers) with Dask."""
    if ctx.invoked_subcommand != "submit":
        resume_collection()  # submit collects again once its cluster is ready


@cli.command(context_settings=_CONTEXT)
@click.argument(
    "job_files", metavar="JOB_FILE...", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option("--devices", help="all, a count (2) or device ids (0,1); overrides cluster.devices")
@click.option(
    "--workers-per-device", metavar="N", help="worker processes per GPU; overrides cluster.workers_per_device"
)
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), help="overrides cluster.backend")
@click.option("--allocator", type=click.Choice(AllocatorChoice.names()), help="overrides cluster.allocator")
@click.option("--scheduler", metavar="ADDR", help="join a running cluster (address or scheduler file)")
@click.option(
    "--scheduler-file",
    metavar="PATH",
    type=click.Path(exists=True, dir_okay=False),
    help="join the running cluster whose scheduler wrote PATH (dask scheduler --scheduler-file)",
)
@click.option("--tls-ca-file", metavar="PEM", help="CA certificate(s) for a TLS scheduler (tls://)")
@click.option("--tls-cert", metavar="PEM", help="this client's certificate for a TLS scheduler")
@click.option("--tls-key", metavar="PEM", help="this client's private key (unless it is in --tls-cert)")
@click.option("--dashboard", metavar="ADDR", help="dashboard address (default 127.0.0.1:8787)")
@click.option("--no-dashboard", is_flag=True, help="start no dashboard")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a job key, e.g. params.m=4096")
@click.option(
    "--json",
    "json_path",
    metavar="PATH",
    help="write the result as JSON (- for stdout); a list of results for several jobs",
)
@click.option("--no-verify", is_flag=True, help="skip checking the tiles")
@click.option("--force", is_flag=True, help="replace output files that already exist")
@click.option("--quiet", "-q", is_flag=True, help="no progress bar and no table")
@click.option("--keep-open", is_flag=True, help="keep the cluster and dashboard up after the jobs until Ctrl-C")
@click.option("--dry-run", is_flag=True, help="check, plan and estimate the jobs; start nothing")
@click.option(
    "--own-cluster", is_flag=True, help="start a cluster for these jobs even where mgpu cluster up has one running"
)
def submit(
    job_files: tuple[Path, ...],
    devices: str | None,
    workers_per_device: str | None,
    backend: str | None,
    allocator: str | None,
    scheduler: str | None,
    scheduler_file: str | None,
    tls_ca_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    dashboard: str | None,
    no_dashboard: bool,
    sets: tuple[str, ...],
    json_path: str | None,
    no_verify: bool,
    force: bool,
    quiet: bool,
    keep_open: bool,
    dry_run: bool,
    own_cluster: bool,
) -> None:
    """Run job files, one after another on one cluster, and report each.

    Without a scheduler (in the job or given here), the jobs run on the cluster that
    mgpu cluster up started, if one is up; else on one started for them.
    """
    if scheduler and scheduler_file:
        raise click.UsageError("give --scheduler or --scheduler-file, not both")
    scheduler = scheduler or (str(Path(scheduler_file).resolve()) if scheduler_file else None)
    overrides = _overrides(
        sets,
        backend=backend,
        allocator=allocator,
        scheduler=scheduler,
        workers_per_device=workers_per_device,
        dashboard=dashboard,
        no_dashboard=no_dashboard,
        no_verify=no_verify,
    )
    if devices is not None:
        overrides.append(f"cluster.devices={_devices_override(devices)}")
    if force:
        overrides.append("force=true")

    # With JSON on stdout, everything meant for a person goes to stderr.
    console = Console(stderr=json_path == "-" or quiet, quiet=quiet)
    reporter = _Reporter(
        console, show_progress=not quiet and console.is_terminal and json_path != "-", files=list(job_files)
    )
    reporter.keep_open = keep_open
    not_run = ""
    if dry_run:
        _dry_run(job_files, overrides, json_path)
        return
    try:
        running = None if own_cluster or scheduler else _running_cluster()
        if scheduler or running is not None:
            _client_only()  # before the jobs load: their workloads import Dask's client
        from .info import read_versions_meanwhile

        read_versions_meanwhile()
        jobs = [load_job(f, overrides) for f in job_files]
        joins = running if running is not None and not any(j.cluster.scheduler for j in jobs) else None
        from .connection import ahead

        # The connection to the running cluster (else what connecting reports), made while the jobs are checked.
        ahead(joins.address if joins is not None and not (tls_ca_file or tls_cert or tls_key) else None)
        security = client_security(tls_ca_file, tls_cert, tls_key)
        if joins is not None:
            jobs = _on_running_cluster(jobs, joins, console)
        if all(j.cluster.scheduler for j in jobs):
            _client_only()
        from .client.preflight import check_written  # after _client_only: it imports Dask's client

        check_written(json_path, key="--json", jobs=jobs, read=job_files)
        try:
            from .api import run_all

            with cancel_on_signals():
                run_all(jobs, events=reporter, security=security)
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
        _fail(
            f"interrupted ({e}); the job's tasks were cancelled, the cluster mgpu started was closed, "
            f"and no partial output was kept{not_run}",
            e.exit_code,
        )
    except KeyboardInterrupt:
        _fail("interrupted; the cluster was closed and no output was kept", 130)

    if reporter.results[-1].status != "ok":
        _fail(f"verification failed: the result is wrong{not_run}", JobFailed.exit_code)


def _client_only() -> None:
    """Keep RMM and NVML out of this process, which joins a cluster and runs no GPU code:
    importing Dask's client would import them (for its diagnostics) where they are
    installed, which costs the command time and gives it nothing."""
    for name in ("rmm", "pynvml"):
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # an import of it raises ImportError
    from .forkserver import stop

    stop()  # no workers of its own to fork


def _running_cluster() -> Any:
    """The cluster mgpu cluster up started, if one is up (else None)."""
    from .background import find

    return find()


def _on_running_cluster(jobs: list[Any], running: Any, console: Console) -> list[Any]:
    """``jobs`` pointed at ``running``, the cluster mgpu cluster up started (saying so)."""
    from .api import as_job

    console.print(
        f"mgpu: joining the running cluster at {running.address} (mgpu cluster up; --own-cluster starts one instead)",
        soft_wrap=True,
    )
    return [as_job(j, [f"cluster.scheduler={running.address}"]) for j in jobs]


def _dry_run(job_files: tuple[Path, ...], overrides: list[str], json_path: str | None) -> None:
    """``submit --dry-run``: each job's plan for the devices it would get, and its estimate."""
    from .client.estimate import as_json, describe, dry_run

    try:
        jobs = [load_job(f, overrides) for f in job_files]
        from .client.preflight import check_written

        check_written(json_path, key="--json", jobs=jobs, read=job_files)
        runs = dry_run(jobs)
    except JobInputError as e:
        _fail(str(e), JobInputError.exit_code)
    console = Console(stderr=json_path == "-")
    for run in runs:
        for line in describe(run):
            console.print(line, soft_wrap=True)
    if json_path:
        docs = [as_json(r) for r in runs]
        text = json.dumps(docs if len(docs) > 1 else docs[0], indent=2)
        _emit_json(text, json_path)


def _emit_json(text: str, json_path: str) -> None:
    """``text`` on stdout (``-``) or into the file; a write that fails is one line, exit 1."""
    if json_path == "-":
        click.echo(text)
        return
    try:
        write_text(json_path, text + "\n", key="--json")
    except JobFailed as e:
        _fail(str(e), JobFailed.exit_code)


def _write_json(results: list[Any], json_path: str | None, *, several: bool) -> None:
    """One object for one job; a list, in submission order, for several (those that ran)."""
    if not json_path or not results:
        return
    if several:
        text = json.dumps([r.model_dump(mode="json") for r in results], indent=2)
    else:
        text = results[0].model_dump_json(indent=2)
    _emit_json(text, json_path)


@cli.command(context_settings=_CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="print the facts as JSON")
@click.option("--calibrate", is_flag=True, help="measure each device's ceilings (copies, and each workload's own) anew")
def info(as_json: bool, calibrate: bool) -> None:
    """List the GPUs, their links, versions, allocators and transports."""
    from .info import machine_info
    from .roofline import ceiling_units

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
            console.print(
                f"  GPU {g['id']}: {g['name']}, {g['memory'] / 2**30:.1f} GiB, "
                f"compute capability {g['compute_capability']}{nvl}"
            )
        pairs = ", ".join(f"{a}->{b}" for a, b in facts["peer_access"]) or "none"
        console.print(f"peer access: {pairs}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in facts["versions"].items()))
    console.print(f"allocators: {', '.join(facts['allocators'])}; UCX: {'yes' if facts['ucx'] else 'no'}")
    units = ceiling_units() if facts.get("ceilings") else {}
    for dev, rates in facts.get("ceilings", {}).items():
        console.print(
            f"ceilings of {dev}: "
            + ", ".join(f"{k} {v:.4g} {units.get(k, '')}".rstrip() for k, v in sorted(rates.items()))
        )


def _calibrate() -> dict[str, dict[str, float]]:
    """Start a cluster on every device, measure each alone, and refresh the cache."""
    from .cluster import open_cluster, resolve_cluster
    from .roofline import ceilings_for
    from .spec import ClusterSpec

    with open_cluster(resolve_cluster(ClusterSpec(dashboard=None))) as cluster:
        rates = ceilings_for(cluster.client, cluster.devices, refresh=True)
        return {f"{f.host}:{f.backend}{f.id}": rates[addr] for addr, f in cluster.devices.items()}


class _SweepReporter(_Reporter):
    """A sweep's runs: the tile bar of each, and the dashboard's address once."""

    told_dashboard = False

    def cluster_ready(self, info: Any) -> None:
        if info.dashboard_link and not self.told_dashboard:
            _tell_dashboard(self.console, info, " (each run starts its cluster anew)")
            self.told_dashboard = True

    def planned(self, plan: Any) -> None:
        self.start_bar(len(plan.tiles))


@cli.command(context_settings=_CONTEXT)
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="folder for scale.csv, scale.json, the plots, REPORT.md and each run's result",
)
@click.option("--devices", "counts", metavar="N,N,...", help="device counts (default 1, 2, 4, ... up to all)")
@click.option(
    "--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="runs per device count and size"
)
@click.option("--weak", is_flag=True, help="grow the problem with the devices (the job's scale.grow)")
@click.option(
    "--workers-per-device",
    metavar="N",
    help="worker processes per GPU at every count; overrides cluster.workers_per_device",
)
@click.option("--sizes", metavar="KEY[,KEY]=V,V,...", help="sweep sizes, e.g. params.n=1e8,2e8 or m,n,k=2048,4096")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), help="overrides cluster.backend")
@click.option("--allocator", type=click.Choice(AllocatorChoice.names()), help="overrides cluster.allocator")
@click.option("--dashboard", metavar="ADDR", help="dashboard address (default 127.0.0.1:8787)")
@click.option("--no-dashboard", is_flag=True, help="start no dashboard")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a job key, e.g. params.m=4096")
@click.option("--no-verify", is_flag=True, help="skip checking the tiles")
@click.option("--force", is_flag=True, help="replace a sweep already in --out, and the job's output files")
@click.option("--quiet", "-q", is_flag=True, help="no progress and no table")
def scale(
    job_file: Path,
    out_dir: Path,
    counts: str | None,
    repeat: int,
    weak: bool,
    workers_per_device: str | None,
    sizes: str | None,
    backend: str | None,
    allocator: str | None,
    dashboard: str | None,
    no_dashboard: bool,
    sets: tuple[str, ...],
    no_verify: bool,
    force: bool,
    quiet: bool,
) -> None:
    """Run a job on several device counts (and sizes) and report how it scales."""
    from .cluster import resolve_cluster
    from .report import row_from_result, size_label, with_efficiency, write_report
    from .scale import default_counts, parse_counts, parse_sizes, plan_sweep, run_sweep

    overrides = _overrides(
        sets,
        backend=backend,
        allocator=allocator,
        workers_per_device=workers_per_device,
        dashboard=dashboard,
        no_dashboard=no_dashboard,
        no_verify=no_verify,
    )
    console = Console(stderr=True, quiet=quiet)  # a line per run; the table goes to stdout
    reporter = _SweepReporter(console, show_progress=not quiet and console.is_terminal)
    rows: list[dict[str, Any]] = []
    env: dict[str, Any] = {}  # the last run's environment, for the report
    try:
        check_folder(out_dir, key="--out")
        if (out_dir / "scale.json").exists() and not force:
            raise JobInputError(
                f"--out: {str(out_dir)!r} already holds a sweep (scale.json); choose another folder or pass --force"
            )
        if counts is None:
            base = load_job(job_file, overrides)
            device_counts = default_counts(resolve_cluster(base.cluster).backend)
        else:
            device_counts = parse_counts(counts)
        runs = plan_sweep(
            job_file, device_counts, repeat, weak=weak, sizes=parse_sizes(sizes) if sizes else None, overrides=overrides
        )
        (out_dir / "runs").mkdir(parents=True, exist_ok=True)
        first = runs[0].job
        mode = "weak" if weak else "strong"
        title = f"{first.name}: {mode} scaling" + (f" ({first.workload})" if first.name != first.workload else "")
        console.print(
            f"mgpu: {len(runs)} runs, {mode} scaling: {', '.join(map(str, device_counts))} devices"
            f"{', sizes ' + sizes if sizes else ''}, {repeat} run{'s' * (repeat != 1)} each",
            soft_wrap=True,
        )
        try:
            for i, outcome in enumerate(run_sweep(runs, reporter, force=force)):
                reporter.close()
                run, result = outcome.run, outcome.result
                if result is None:  # not yielded without keep_going: a failed run raises
                    raise JobFailed(outcome.error or "no result")
                env = {k: v for k, v in result.env.items() if k != "worker"}
                rows.append(
                    row_from_result(
                        result,
                        repeat=run.repeat,
                        mode=run.mode,
                        base_size=size_label(result.workload, run.base_size),
                        source=f"runs/{i + 1:03d}-{run.devices}dev-r{run.repeat + 1}.json",
                    )
                )
                (out_dir / rows[-1]["source"]).write_text(result.model_dump_json(indent=2) + "\n")
                row = with_efficiency(rows)[-1]
                eff = f", efficiency {row['efficiency']:.0%}" if row["efficiency"] is not None else ""
                bad = ", [red]verification FAILED[/red]" if not outcome.verified else ""
                console.print(
                    f"mgpu: run {i + 1}/{len(runs)}: {run.devices} device{'s' * (run.devices != 1)}, "
                    f"{row['size']}, repeat {run.repeat + 1}/{repeat}: {row['seconds']:.3f} s, "
                    f"{row['throughput']:.4g} {row['unit']}{eff}{bad}",
                    soft_wrap=True,
                )
        finally:
            reporter.close()
            if rows:  # also after a failure: the runs done so far are kept
                files = write_report(
                    out_dir,
                    rows,
                    title=title,
                    command="scale",
                    lines=[
                        f"`mgpu scale {job_file} --devices {','.join(map(str, device_counts))} --repeat {repeat}"
                        f"{' --weak' if weak else ''}{' --sizes ' + sizes if sizes else ''}`, "
                        f"{len(rows)} runs on {rows[-1]['backend']} ({rows[-1]['gpu'] or 'CPU workers'}, "
                        f"host {rows[-1]['host']}); each run on a cluster started anew."
                    ],
                    job=first.as_dict(),
                    mode=mode,
                    devices=device_counts,
                    repeat=repeat,
                    env=env,
                )
    except JobInputError as e:
        _fail(str(e), JobInputError.exit_code)
    except JobFailed as e:
        _fail(
            f"job failed: {e}" + (f"; the {len(rows)} runs before it are in {out_dir}" if rows else ""),
            JobFailed.exit_code,
        )
    except KeyboardInterrupt:
        _fail("interrupted" + (f"; the {len(rows)} runs before it are in {out_dir}" if rows else ""), 130)
    _print_summary(rows, [], Console(quiet=quiet))
    Console(stderr=True, quiet=quiet).print(f"mgpu: wrote {', '.join(str(p) for p in files.values())}", soft_wrap=True)
    if any(r["status"] != "ok" for r in rows):
        _fail("verification failed in some runs: their results are wrong", JobFailed.exit_code)


@cli.command(context_settings=_CONTEXT)
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--by",
    default="devices",
    show_default=True,
    type=click.Choice(["devices", "allocator", "protocol", "host", "gpu", "backend", "workload", "job", "source"]),
    help="compare runs side by side by this field (devices: one line per job and size)",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="also write report.csv, report.json, the plots and REPORT.md here",
)
def report(files: tuple[Path, ...], by: str, out_dir: Path | None) -> None:
    """Tabulate saved results (submit --json, scale.json), and plot them with --out."""
    from .report import load_rows, write_report

    fields = [] if by == "devices" else [by]
    try:
        rows = load_rows(files)
    except JobInputError as e:
        _fail(str(e), JobInputError.exit_code)
    _print_summary(rows, fields, Console())
    if out_dir is not None:
        written = write_report(
            out_dir,
            rows,
            by=fields,
            command="report",
            title="mgpu results" + (f" by {by}" if fields else ""),
            lines=[
                f"{len(rows)} runs from {len(files)} file(s): " + ", ".join(sorted({r["source"] for r in rows})[:12])
            ],
        )
        Console(stderr=True).print(f"mgpu: wrote {', '.join(str(p) for p in written.values())}", soft_wrap=True)


def _print_summary(rows: list[dict[str, Any]], by: list[str], console: Console) -> None:
    from rich.table import Table

    from .report import summarize, table_rows

    if not rows:
        return
    if not console.is_terminal and not console.quiet:
        console = Console(file=console.file, width=160)  # a log or pipe: no terminal to fit
    header, cells = table_rows(summarize(rows, by), by)
    table = Table(title="median (min–max) of the runs at each device count", title_justify="left")
    for name in header:
        table.add_column(name, overflow="fold")
    for row in cells:
        table.add_row(*row)
    console.print(table)


def _fail(message: str, code: int) -> None:
    click.echo(f"mgpu: error: {message}" if code == 2 else f"mgpu: {message}", err=True)
    sys.exit(code)


def _wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM; either ends the wait normally, so the cluster closes."""
    stop = threading.Event()
    try:
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: Ctrl-C arrives as KeyboardInterrupt instead
        previous = {}
    try:
        while not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _spawn_without_the_script() -> None:
    """Have the worker processes of a cluster this command starts skip the ``mgpu`` script.

    A process multiprocessing spawns first imports its parent's main module: for the
    ``mgpu`` script, mgpu's whole command line (rich, the result's table), in every
    worker before its own start. Named as ``python -m mgpu`` names it (``mgpu.__main__``),
    the main module is left out.
    """
    script = sys.modules.get("__main__")
    if script is not None and getattr(script, "__spec__", None) is None and is_command():
        script.__spec__ = importlib.util.find_spec("mgpu.__main__")


def main() -> None:
    """Entry point of ``mgpu`` and ``python -m mgpu``.

    Ctrl-C and SIGTERM end any command with one line and exit 130 or 143: a run stops its
    tasks and closes its cluster first (see :mod:`mgpu.signals`); click's own handling would
    print "Aborted!" and exit 1.
    """
    _spawn_without_the_script()
    try:
        with cancel_on_signals():
            try:
                code = cli.main(prog_name="mgpu", standalone_mode=False)
            except click.exceptions.Abort as e:
                signum = e.__cause__.signum if isinstance(e.__cause__, Interrupted) else signal.SIGINT
                _fail(f"interrupted ({signal.Signals(signum).name})", 128 + signum)
            except click.ClickException as e:
                e.show()
                sys.exit(e.exit_code)
    except SystemExit as e:
        code = e.code
    finally:
        finish()
    end(code if isinstance(code, (int, str)) or code is None else 0)
