"""The job file: YAML -> a validated :class:`Job`, every error naming its key.

The workload's own ``params`` are validated by the model the workload registers, so
``params.m: Input should be greater than 0`` reads the same as a cluster key's error.
"""

from __future__ import annotations

import codecs
import copy
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import JobInputError
from .memory import AllocatorChoice
from .sizes import parse_size
from .workloads import get_workload_class, workload_names

__all__ = [
    "MAX_WORKERS_PER_DEVICE",
    "ClusterSpec",
    "Job",
    "ScaleSpec",
    "apply_overrides",
    "check_one_cluster",
    "load_job",
    "validate_cluster",
]

# Worker processes that may share one GPU: each holds a CUDA context (~0.5 GiB) and its
# own pool, so past a few dozen the contexts alone crowd the device.
MAX_WORKERS_PER_DEVICE = 32


class ClusterSpec(BaseModel):
    """Where and how the job runs (the ``cluster:`` section)."""

    # use_enum_values: cluster.allocator holds the choice as written ("pool"), as the job's JSON does.
    model_config = ConfigDict(extra="forbid", use_enum_values=True)

    backend: Literal["auto", "cuda", "cpu"] = "auto"
    devices: Literal["all"] | int | list[int] = "all"
    workers_per_device: int = 1
    # NVIDIA's MPS for the workers that share a GPU (see mgpu.mps): "auto" where installed.
    mps: Literal["auto"] | bool = "auto"
    allocator: AllocatorChoice = AllocatorChoice.POOL
    memory_limit: Literal["auto"] | int | float | str = "auto"
    spill: Literal["none", "managed"] = "managed"
    protocol: Literal["auto", "tcp", "ucx"] = "auto"
    scheduler: str | None = None
    dashboard: str | None = Field(
        "127.0.0.1:8787", description="address the Dask dashboard listens on; null turns it off"
    )

    @field_validator("devices", "memory_limit", "workers_per_device", mode="before")
    @classmethod
    def _not_bool(cls, v: Any, info: ValidationInfo) -> Any:
        # Before validation: pydantic would read true as the count or size 1.
        if isinstance(v, bool):
            allowed = {
                "devices": "'all', a count or a list of device ids",
                "workers_per_device": f"a whole number from 1 to {MAX_WORKERS_PER_DEVICE}",
                "memory_limit": "'auto', bytes, a fraction or a size like '40GB'",
            }[str(info.field_name)]
            raise ValueError(f"expected {allowed}, got {str(v).lower()}")
        return v

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"a device count must be at least 1, got {v}; for device 0 alone write [0] (--devices 0,)")
        if isinstance(v, list):
            if not v:
                raise ValueError("the list of device ids is empty")
            if any(i < 0 for i in v):
                raise ValueError(f"device ids are 0 or more, got {v}")
            if len(set(v)) != len(v):
                raise ValueError(f"device ids repeat in {v}")
        return v

    @field_validator("workers_per_device")
    @classmethod
    def _workers_per_device(cls, v: int) -> int:
        if not 1 <= v <= MAX_WORKERS_PER_DEVICE:
            raise ValueError(f"expected a whole number from 1 to {MAX_WORKERS_PER_DEVICE}, got {v}")
        return v

    @field_validator("mps", mode="before")
    @classmethod
    def _mps(cls, v: Any) -> Any:
        if v == "auto" or isinstance(v, bool):
            return v
        raise ValueError(f"expected auto (MPS where installed), true or false, got {v!r}")

    @field_validator("memory_limit")
    @classmethod
    def _memory_limit(cls, v: Any) -> Any:
        return v if v == "auto" else parse_size(v, key="cluster.memory_limit")

    @field_validator("dashboard", mode="before")
    @classmethod
    def _dashboard(cls, v: Any) -> Any:
        # A bare port (--dashboard 8790) stays on the loopback interface, like the default.
        if isinstance(v, int) and not isinstance(v, bool):
            v = f"127.0.0.1:{v}"
        if v is None:
            return v
        host, sep, port = str(v).rpartition(":")
        if not isinstance(v, str) or not sep or not port.isdigit() or int(port) > 65535 or " " in host:
            raise ValueError(
                f"expected HOST:PORT (127.0.0.1:8787), a port alone (8790, on 127.0.0.1), or null for none; got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _pairs(self) -> ClusterSpec:
        if self.allocator == "managed" and self.spill == "managed":
            # Everything is already managed memory: there is nothing to fall back to.
            object.__setattr__(self, "spill", "none")
        return self


class ScaleSpec(BaseModel):
    """How ``mgpu scale --weak`` grows the job with the device count (the ``scale:`` section)."""

    model_config = ConfigDict(extra="forbid")

    grow: list[str] | None = Field(None, description="params grown with the device count; null: the workload's default")

    @field_validator("grow", mode="before")
    @classmethod
    def _one_name(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("grow")
    @classmethod
    def _grow(cls, v: Any) -> Any:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError(f"expected a non-empty list of params without repeats, got {v}")
        return v


class Job(BaseModel):
    """A validated job: what to run (``workload`` + ``params``) and where (``cluster``)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    workload: str
    params: BaseModel
    cluster: ClusterSpec = ClusterSpec()
    tiling: Literal["auto"] | dict[str, int] = "auto"
    verify: bool = True
    force: bool = Field(False, description="replace outputs that already exist")
    scale: ScaleSpec = ScaleSpec()

    @field_validator("tiling")
    @classmethod
    def _tiling(cls, v: Any) -> Any:
        if isinstance(v, dict):
            bad = {k: n for k, n in v.items() if n < 1}
            if bad:
                raise ValueError(f"tile sizes must be at least 1, got {bad}")
        return v

    def as_dict(self) -> dict[str, Any]:
        """The job as run, every default filled in: feeding it back repeats the run."""
        out = self.model_dump(mode="json", exclude={"force"})
        out["params"] = self.params.model_dump(mode="json")
        return out


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys a section allows, for an unknown key at ``loc`` (top level or one down)."""
    if len(loc) == 2:
        field = model.model_fields.get(str(loc[0]))
        sub = field.annotation if field else None
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            model = sub
        else:
            return []
    elif len(loc) != 1:
        return []
    return sorted(model.model_fields)


_KEY_IN_MESSAGE = re.compile(r"([A-Za-z_][\w.]*): (.+)", re.DOTALL)


def _format_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    lines: dict[str, str] = {}
    for e in err.errors():
        # Union branches add their tags to the location; only the keys matter to a user.
        keys = tuple(
            p
            for p in e["loc"]
            if not str(p).startswith(
                ("function-", "literal[", "str", "int", "float", "list[", "dict[", "bool", "none", "tagged")
            )
        )
        where = prefix + ".".join(str(p) for p in keys) if keys else prefix.rstrip(".") or "job"
        msg = e["msg"].removeprefix("Value error, ")
        # Validators name their own key: "cluster.memory_limit: ..." from the size parser,
        # "m: required ..." from a model-level check; name it once, in full.
        msg = msg.removeprefix(f"{where}: ")
        named = _KEY_IN_MESSAGE.match(msg) if not keys else None
        if named:
            where, msg = prefix + named[1], named[2]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            allowed = _allowed_keys(model, keys)
            if allowed:
                msg += f"; allowed: {', '.join(allowed)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        # Pydantic reports each failed branch of a union; the first says enough.
        lines.setdefault(where, f"{where}: {msg}")
    return "\n".join(lines.values())


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold true or false (pydantic's lax mode would read
    them as 1 and 0 for an int or float)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    return any(_takes_bool(a) for a in get_args(annotation) if get_origin(annotation) is not dict)


def _no_bool_for_number(raw: dict[str, Any], model: type[BaseModel], prefix: str) -> None:
    """Refuse true/false given for a key that is not a yes/no, naming the key."""
    for key, value in raw.items():
        field = model.model_fields.get(str(key))
        if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
            raise JobInputError(f"{prefix}{key}: expected {_kind(field.annotation)}, got {str(value).lower()}")


def _kind(annotation: Any) -> str:
    args = {a for a in get_args(annotation)} | {annotation}
    if int in args:
        return "an integer"
    if float in args:
        return "a number"
    return "a value of its kind, not true/false"


def _set_dotted(doc: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = doc
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise JobInputError(f"--set {dotted}: {key!r} is not a section of the job")
        node = child
    node[keys[-1]] = value


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set key.sub=value`` overrides; values are read as YAML (``4096``, ``[0, 1]``)."""
    doc = copy.deepcopy(doc)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise JobInputError(f"--set {item!r}: expected KEY=VALUE, e.g. --set params.m=4096")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        _set_dotted(doc, key.strip(), value)
    return doc


def yaml_text(path: Path, *, key: str) -> str:
    """The text of a YAML file, read as UTF-8; anything else (UTF-16, binary, bytes that
    are not UTF-8, a directory, a FIFO) is an input error naming the file."""
    if not path.exists():
        raise JobInputError(f"{key} {str(path)!r} does not exist")
    if path.is_dir():
        raise JobInputError(f"{key} {str(path)!r} is a directory, not a file")
    if not path.is_file():
        raise JobInputError(f"{key} {str(path)!r} is not a regular file (a FIFO or device?); give a YAML file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise JobInputError(f"{key} {str(path)!r} cannot be read: {e.strerror}") from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        raise JobInputError(f"{key} {str(path)!r} is UTF-16 or UTF-32 text; save it as UTF-8")
    if b"\x00" in data:
        raise JobInputError(f"{key} {str(path)!r} is binary (it holds NUL bytes), not a YAML text file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise JobInputError(
            f"{key} {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); save it as UTF-8"
        ) from None


def read_job_file(path: str | Path) -> dict[str, Any]:
    """Read a job file with the safe YAML loader; a missing or malformed file is an input error."""
    path = Path(path)
    doc = yaml_text(path, key="job file")
    try:
        doc = yaml.safe_load(doc)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise JobInputError(f"job file {str(path)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(doc, dict):
        raise JobInputError(f"job file {str(path)!r} must be a mapping of keys (workload:, params:, ...)")
    doc.setdefault("name", path.stem)
    return doc


def validate_job(doc: dict[str, Any]) -> Job:
    """Validate a job document (already read and overridden) into a :class:`Job`.

    Raises
    ------
    JobInputError
        With one line per wrong key, each naming the key and what is allowed.
    """
    doc = dict(doc)
    doc.setdefault("name", "job")
    unknown = [str(k) for k in doc if k not in Job.model_fields]
    if unknown:
        raise JobInputError(f"{unknown[0]}: unknown key; allowed: {', '.join(sorted(Job.model_fields))}")
    workload = doc.get("workload")
    if workload is None:
        raise JobInputError(f"workload: required key is missing; one of: {', '.join(workload_names())}")
    if not isinstance(workload, str):
        raise JobInputError(f"workload: expected a name, one of: {', '.join(workload_names())}")
    try:
        cls = get_workload_class(workload)
    except KeyError:
        raise JobInputError(f"workload: unknown workload {workload!r}; one of: {', '.join(workload_names())}") from None
    raw_params = doc.get("params") or {}
    if not isinstance(raw_params, dict):
        raise JobInputError("params: expected a mapping of the workload's parameters")
    _no_bool_for_number(raw_params, cls.Params, "params.")
    if isinstance(doc.get("tiling"), dict):
        for axis, size in doc["tiling"].items():
            if isinstance(size, bool):
                raise JobInputError(f"tiling.{axis}: expected a tile size (an integer), got {str(size).lower()}")
    try:
        params = cls.Params.model_validate(raw_params)
    except ValidationError as e:
        raise JobInputError(_format_error(e, cls.Params, "params.")) from None
    doc["params"] = params
    try:
        job = Job.model_validate(doc)
    except ValidationError as e:
        raise JobInputError(_format_error(e, Job)) from None
    unknown = [k for k in job.scale.grow or () if k not in cls.size_params]
    if unknown:
        raise JobInputError(
            f"scale.grow: {unknown[0]!r} is not a size of {workload}; "
            f"allowed: {', '.join(cls.size_params) or 'none (it has no sizes to grow)'}"
        )
    return job


def validate_cluster(doc: dict[str, Any]) -> ClusterSpec:
    """Validate a ``cluster:`` section alone (``mgpu cluster up``'s flags).

    Raises
    ------
    JobInputError
        With one line per wrong key, each naming the key (``cluster.devices``) and what is allowed.
    """
    try:
        return ClusterSpec.model_validate(doc)
    except ValidationError as e:
        raise JobInputError(_format_error(e, ClusterSpec, "cluster.")) from None


def load_job(path: str | Path, overrides: list[str] | None = None) -> Job:
    """Read, override and validate a job file.

    Parameters
    ----------
    path
        The YAML job file.
    overrides
        ``key.sub=value`` strings, applied in order (``--set``).

    Returns
    -------
    Job
        The validated job; relative input and output paths are resolved against the
        current directory, as a shell user expects.

    Raises
    ------
    JobInputError
        If the file is missing, malformed, or any key is wrong.
    """
    doc = read_job_file(path)
    doc = apply_overrides(doc, overrides or [])
    return validate_job(doc)


def check_one_cluster(jobs: Sequence[Job]) -> None:
    """Jobs submitted together run on one cluster, so their ``cluster:`` sections must agree.

    Raises
    ------
    JobInputError
        Naming the first key that differs and the two jobs.
    """
    first = jobs[0]
    for job in jobs[1:]:
        for key in ClusterSpec.model_fields:
            mine, theirs = getattr(job.cluster, key), getattr(first.cluster, key)
            if mine != theirs:
                raise JobInputError(
                    f"cluster.{key}: job {job.name!r} has {mine!r} but the first job, {first.name!r}, has "
                    f"{theirs!r}; jobs submitted together run on one cluster, so their cluster sections must "
                    f"agree (make them agree, e.g. --set cluster.{key}=..., or submit them separately)"
                )
