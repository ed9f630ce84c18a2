"""mgpu's settings: the ``mgpu.*`` keys of Dask's configuration in one typed object.

``mgpu.yaml`` beside this module holds every key with its default and is registered with
Dask when mgpu is imported (as ``distributed.yaml`` is); ``mgpu-schema.yaml`` says what each
key may hold. :func:`load` reads and checks them: the client calls it once before a cluster
starts (a bad value is a :class:`~mgpu.errors.JobInputError` naming the key, exit 2), and
:class:`~mgpu.worker.plugins.SettingsSetup` hands the checked values to every worker, so a worker
of a cluster mgpu joins runs with the client's settings. Modules ask :func:`load`, never
Dask, for a key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from .errors import JobInputError

__all__ = [
    "READ_METHODS",
    "Ceilings",
    "WRITE_METHODS",
    "Io",
    "ReadMethod",
    "Recovery",
    "Settings",
    "Transfer",
    "WriteMethod",
    "load",
]

DEFAULTS_PATH = Path(__file__).with_name("mgpu.yaml")
SCHEMA_PATH = Path(__file__).with_name("mgpu-schema.yaml")
ReadMethod = Literal["auto", "kvikio", "mmap"]
READ_METHODS: tuple[str, ...] = get_args(ReadMethod)
WriteMethod = Literal["mmap", "pwrite", "kvikio"]
WRITE_METHODS: tuple[str, ...] = get_args(WriteMethod)

dask.config.update_defaults(yaml.safe_load(DEFAULTS_PATH.read_text()))


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=_kebab, populate_by_name=True)


def _positive_bytes(value: Any, example: str) -> int:
    try:
        nbytes = parse_bytes(value) if isinstance(value, str) else value
    except ValueError:
        nbytes = None
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
        raise ValueError(f"{value!r} is not a positive number of bytes (e.g. {example})")
    return nbytes


class Io(_Section):
    """``mgpu.io``: how GPU workers read ``.npy`` inputs and write outputs (KvikIO, see :mod:`mgpu.worker.io`)."""

    read: ReadMethod = "auto"
    write: WriteMethod = "mmap"
    writers: int | Literal["auto"] = "auto"  # auto: see worker.io.writers
    threads: int = 16
    task_size: int = 8 << 20

    @field_validator("read", "write", mode="before")
    @classmethod
    def _method(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = READ_METHODS if info.field_name == "read" else WRITE_METHODS
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{value!r} is not a positive whole number")
        return value

    @field_validator("task_size", mode="before")
    @classmethod
    def _task_size(cls, value: Any) -> int:
        return _positive_bytes(value, "8MiB")

    @field_validator("writers", mode="before")
    @classmethod
    def _writers(cls, value: Any) -> int | str:
        return _count_or_auto(value, "auto (the host copy threads, or 2 with write: pwrite)")


class Transfer(_Section):
    """``mgpu.transfer``: how workers stage copies between host memory and GPU."""

    chunk_bytes: int = 16 << 20
    host_threads: int | Literal["auto"] = "auto"  # auto: the worker's own (see transfer.host_threads)

    @field_validator("chunk_bytes", mode="before")
    @classmethod
    def _chunk_bytes(cls, value: Any) -> int:
        return _positive_bytes(value, "16MiB")

    @field_validator("host_threads", mode="before")
    @classmethod
    def _host_threads(cls, value: Any) -> int | str:
        return _count_or_auto(value, "auto (half the cores, at most 16)")


def _count_or_auto(value: Any, auto: str) -> int | str:
    """``"auto"``, or a positive whole number (one given as text too)."""
    if value == "auto":
        return value
    try:
        n = int(value) if not isinstance(value, (bool, float)) else 0
    except (TypeError, ValueError):  # None, a list, "many"
        n = 0
    if n < 1:
        raise ValueError(f"{value!r} is not a positive whole number or {auto}")
    return n


class Recovery(_Section):
    """``mgpu.recovery``: what a job does when it loses workers."""

    wait_for_workers: float = 30.0  # seconds
    # A worker that finishes none of its tiles for slack x a tile's estimated time (and at
    # least the floor) is taken as stuck: retired, its tiles run elsewhere.
    tile_deadline_slack: float = 5.0
    tile_deadline_floor: float = 10.0  # seconds
    tile_deadline_heard: float = 600.0  # seconds, for a worker whose heartbeats still come
    # A stepped job's tiles save their state every this many steps, kept on two workers;
    # 0: never (a job that loses a worker starts its steps again from step 0).
    checkpoint_steps: int = 0

    @field_validator("checkpoint_steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{value!r} is not a whole number of steps, 0 or more (0: no checkpoints)")
        return value

    @field_validator("tile_deadline_slack", mode="before")
    @classmethod
    def _slack(cls, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
            raise ValueError(f"{value!r} is not a factor of at least 1 (e.g. 5)")
        return float(value)

    @field_validator("wait_for_workers", "tile_deadline_floor", "tile_deadline_heard", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> float:
        return _length_of_time(value, "30s, 2 minutes")


class Ceilings(_Section):
    """``mgpu.ceilings``: how a device's ceilings are measured (:mod:`mgpu.roofline`)."""

    # Seconds of back-to-back kernels on a GPU before a sustained ceiling is timed over as
    # long again (the clocks a long job keeps at the power limit, not its first
    # milliseconds'); CPUs need none.
    sustain: float = 1.0
    samples: int = 3  # timed runs of every other ceiling, of which the median is kept

    @field_validator("sustain", mode="before")
    @classmethod
    def _sustain(cls, value: Any) -> float:
        return _length_of_time(value, "1s")

    @field_validator("samples", mode="before")
    @classmethod
    def _samples(cls, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{value!r} is not a positive whole number of timed runs (e.g. 3)")
        return value


def _length_of_time(value: Any, example: str) -> float:
    """A Dask time (``"30s"``, ``"2 minutes"``) or seconds, 0 or more."""
    try:
        seconds = parse_timedelta(value) if isinstance(value, (str, int, float)) else None
    except (TypeError, ValueError, KeyError):
        seconds = None
    if seconds is None or isinstance(value, bool) or seconds < 0:
        raise ValueError(f"{value!r} is not a length of time (e.g. {example})")
    return float(seconds)


class Settings(_Section):
    """Every ``mgpu.*`` key, checked: the value of :func:`load`."""

    cache_dir: str | None = None
    ceilings: Ceilings = Ceilings()
    io: Io = Io()
    recovery: Recovery = Recovery()
    transfer: Transfer = Transfer()

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _folder(cls, value: Any) -> str | None:
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"{value!r} is not a folder (a path, or null for ~/.cache/mgpu)")
        return None if value is None else os.fspath(value)

    def ceilings_folder(self) -> Path:
        """The folder of the ceilings cache (``mgpu.cache-dir``)."""
        if self.cache_dir:
            return Path(self.cache_dir)
        return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "mgpu"

    def as_dask_config(self) -> dict[str, Any]:
        """The settings as Dask configuration (``{"mgpu": {...}}``, the keys as in mgpu.yaml)."""
        return {"mgpu": self.model_dump(by_alias=True)}


def load() -> Settings:
    """The ``mgpu.*`` keys of Dask's configuration, checked.

    Raises
    ------
    JobInputError
        Naming the first key that holds what it may not, and what it may hold; or a key
        mgpu does not know, with the ones it does.
    """
    raw = dask.config.get("mgpu", default=None) or {}
    if not isinstance(raw, dict):
        raise JobInputError(f"mgpu: {raw!r} is not a mapping of mgpu's settings (see mgpu/mgpu.yaml)")
    doc = _canonical(raw)
    try:
        return Settings.model_validate(doc)
    except ValidationError as e:
        raise JobInputError(_message(e)) from None


def _canonical(raw: dict[str, Any]) -> dict[str, Any]:
    """Keys as mgpu.yaml spells them: Dask keeps an environment variable's underscores."""
    return {_kebab(str(k)): _canonical(v) if isinstance(v, dict) else v for k, v in raw.items()}


def _message(error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(["mgpu", *(str(p) for p in first["loc"])])
    if first["type"] == "extra_forbidden":
        section: type[BaseModel] = Settings
        for part in first["loc"][:-1]:
            section = section.model_fields[str(part).replace("-", "_")].annotation  # type: ignore[assignment]
        known = ", ".join(".".join(["mgpu", *map(str, first["loc"][:-1]), _kebab(f)]) for f in section.model_fields)
        return f"{key}: mgpu has no such setting; it has {known}"
    if first["type"] == "model_type":
        return f"{key}: {first['input']!r} is not a mapping of settings (see mgpu/mgpu.yaml)"
    return f"{key}: {first['msg'].removeprefix('Value error, ')}"
