"""``python -m mgpu cluster up|status|down``: a local cluster that outlives one submit."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click
import yaml

from .errors import JobFailed, JobInputError

__all__ = ["cluster"]

_CONTEXT = {"help_option_names": ["-h", "--help"]}


def _fail(message: str, code: int) -> None:
    click.echo(f"mgpu: {message}", err=True)
    raise SystemExit(code)


def _devices(value: str) -> Any:
    """``--devices`` as cluster.devices holds it: all, a count, or a list of ids."""
    value = value.strip()
    if value == "all" or value.isdigit():
        return value if value == "all" else int(value)
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise click.BadParameter("expected all, a count (2) or device ids (0,1)", param_hint="--devices")
    return [int(p) for p in parts]


@click.group(context_settings=_CONTEXT)
def cluster() -> None:
    """Start, show and stop a local cluster that later submits run on."""


@cluster.command(context_settings=_CONTEXT)
@click.option("--devices", help="all (default), a count (2) or device ids (0,1)")
@click.option(
    "--workers-per-device", type=int, metavar="N", help="worker processes per GPU (cluster.workers_per_device)"
)
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), help="default auto: GPUs where there are some")
@click.option("--allocator", help="the GPU workers' allocator (default pool), as cluster.allocator")
@click.option("--memory-limit", metavar="SIZE", help="per-device budget, as cluster.memory_limit (default auto)")
@click.option("--dashboard", metavar="ADDR", help="dashboard address (default 127.0.0.1:8787)")
@click.option("--no-dashboard", is_flag=True, help="start no dashboard")
@click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE", help="any key of the cluster: section, as a job sets it"
)
@click.option("--timeout", default=120.0, show_default=True, help="seconds to wait for every worker")
def up(
    devices: str | None,
    workers_per_device: int | None,
    backend: str | None,
    allocator: str | None,
    memory_limit: str | None,
    dashboard: str | None,
    no_dashboard: bool,
    sets: tuple[str, ...],
    timeout: float,
) -> None:
    """Start a scheduler and workers in the background, for submits to run on."""
    from . import background
    from .spec import validate_cluster

    doc: dict[str, Any] = {}
    if devices is not None:
        doc["devices"] = _devices(devices)
    if workers_per_device is not None:
        doc["workers_per_device"] = workers_per_device
    if memory_limit is not None:
        doc["memory_limit"] = yaml.safe_load(memory_limit)
    doc.update({k: v for k, v in {"backend": backend, "allocator": allocator, "dashboard": dashboard}.items() if v})
    if no_dashboard:
        doc["dashboard"] = None
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            _fail(f"--set: expected KEY=VALUE (a key of the cluster: section), got {item!r}", JobInputError.exit_code)
        doc[key.strip().removeprefix("cluster.")] = yaml.safe_load(value)
    try:
        running = background.up(validate_cluster(doc), timeout)
    except JobInputError as e:
        _fail(str(e), JobInputError.exit_code)
    except JobFailed as e:
        _fail(str(e), JobFailed.exit_code)
    click.echo(_describe(running))
    click.echo("mgpu: mgpu submit JOB_FILE runs on it; mgpu cluster down stops it")


@cluster.command(context_settings=_CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="print the record as JSON")
def status(as_json: bool) -> None:
    """Say whether a cluster is up, where, and with how many workers (exit 1 if none)."""
    from . import background

    running = background.find()
    if running is None:
        if as_json:
            click.echo("null")
        else:
            click.echo(f"mgpu: no cluster is up (none recorded in {background.record_path()})")
        raise SystemExit(1)
    click.echo(json.dumps(asdict(running), indent=1) if as_json else _describe(running))


@cluster.command(context_settings=_CONTEXT)
def down() -> None:
    """Stop the cluster cluster up started: its workers, scheduler and dashboard."""
    from . import background

    running = background.down()
    if running is None:
        click.echo("mgpu: no cluster is up; nothing to stop")
        return
    click.echo(f"mgpu: cluster at {running.address} stopped")


def _describe(running: Any) -> str:
    dashboard = running.dashboard or "off"
    workers = f"{running.workers} {'GPU' if running.backend == 'cuda' else running.backend.upper()} worker(s)"
    return f"mgpu: cluster up at {running.address}: {workers}, dashboard {dashboard} (pid {running.pid})"
