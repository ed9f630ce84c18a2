"""``docs/jobs.md`` from the job models: every key, its default and what it allows.

    python -m mgpu.docs > docs/jobs.md

The keys, defaults and allowed values are read from the pydantic models (``Job``, its
``cluster:`` and ``scale:`` sections, each built-in workload's ``params``); the notes
below add what a type cannot say. A test compares the file with this output, so the page
and the models cannot drift apart.
"""

from __future__ import annotations

import types
import typing
from enum import Enum
from typing import Any, Literal

from annotated_types import Ge, Gt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .spec import ClusterSpec, Job, ScaleSpec
from .workloads import get_workload_class, workload_names

__all__ = ["jobs_markdown"]

# What a key's type cannot say. A note (or default) for a key the models no longer have is an error.
NOTES: dict[str, str] = {
    "workload": "a built-in below, or a workload an installed package registers under the `mgpu.workloads` entry point",
    "tiling": "`auto`, or a tile size (≥ 1) per axis: matmul `m`, `n`, `k`; dot `n`; mandelbrot `rows`",
    "verify": "check every tile (see the workload); a failed check fails the job (exit 1)",
    "cluster.backend": "`auto`: cuda where a GPU is visible and CuPy and dask-cuda are installed, else cpu",
    "cluster.devices": "`all`, a count N (GPUs 0..N-1, or N CPU workers), or a list of GPU ids; on CPU `all` is one worker per core",
    "cluster.workers_per_device": "worker processes on each GPU (1 to 32), each with its own pool of 1/N of the device's budget; several share a GPU as MIG slices or small tasks want, and its moves between them stay on the device (CUDA IPC). CPU workers ignore it",
    "cluster.mps": "how workers mgpu starts several to a GPU share it: `auto` runs them under an NVIDIA MPS control daemon of the cluster's own (their kernels side by side in one context) where `nvidia-cuda-mps-control` is installed; `true` requires it (exit 2 without); `false` has them take turns at the GPU. The GPU's settings stay as they are",
    "cluster.allocator": "`pool`: an RMM pool of `memory_limit`; `async`: RMM on cudaMallocAsync; `managed`: CUDA managed memory; `default`: CuPy's own pool",
    "cluster.memory_limit": "the per-device budget the planner tiles for: `auto` (0.8 of a GPU's memory, 0.5 of a CPU worker's), bytes, a fraction of the device's memory, or a size such as `40GB`",
    "cluster.spill": "`managed`: on GPU workers with a pool or async allocator, an allocation past the budget falls back to managed memory and is counted in the result",
    "cluster.protocol": "`auto` is tcp; `ucx` needs distributed-ucxx (the CUDA extras)",
    "cluster.scheduler": "`null` starts a cluster on this machine; else the address (`tcp://host:8786`) or scheduler file of a running one",
    "scale.grow": "matmul `m`, `n`, `k`; dot `n`; mandelbrot `width`, `height`",
    "matmul.m": "with input files, the files' shapes give the sizes, and a size given must agree",
    "matmul.precision": "`tf32`: float32 on TF32 tensor cores (GPU only)",
    "matmul.input": "`random`, or `{a: a.npy, b: b.zarr}`: 2-D `.npy` files or Zarr stores of one float dtype",
    "matmul.output": "`null` (checked, not kept), or a `.npy` or `.zarr` path whose folder exists",
    "matmul.operands": "`distributed`: A and B made once, one row and one column panel per device, B panels copied GPU to GPU",
    "dot.input": "`random`, or `{x: x.npy, y: y.zarr}`: 1-D `.npy` files or Zarr stores of one shape and dtype",
    "mandelbrot.output": "`null`, or `{png: path.png, npy: path.npy}` or `{png: ..., zarr: path.zarr}`, any of them (npy or zarr, not both)",
}


# Defaults a model fills in later than its field's default.
DEFAULTS: dict[str, str] = {
    "name": "the file's name without `.yaml`",
    "matmul.m": "required with `input: random`",
    "matmul.n": "required with `input: random`",
    "matmul.k": "required with `input: random`",
    "matmul.dtype": "`float32`, or the input files' dtype",
    "dot.n": "required with `input: random`",
    "dot.dtype": "`float32`, or the input files' dtype",
    "scale.grow": "`null`: matmul `m`, dot `n`, mandelbrot `height`",
}


def _type(annotation: Any) -> list[str]:
    """What an annotation allows, as short phrases."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return [f"`{'null' if v is None else v}`" for v in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType):
        return [part for arg in typing.get_args(annotation) for part in _type(arg)]
    if origin is list:
        (item,) = typing.get_args(annotation)
        return [f"a list of {_type(item)[0].removeprefix('an ').removeprefix('a ')}s"]
    if origin is dict:
        key, value = typing.get_args(annotation)
        return [
            f"a mapping of {_type(key)[0].removeprefix('a ')} to {_type(value)[0].removeprefix('a ').removeprefix('an ')}"
        ]
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return [f"`{member.value}`" for member in annotation]
    if annotation is type(None):
        return ["`null`"]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ["a section"]
    return {bool: ["`true`", "`false`"], int: ["an integer"], float: ["a number"], str: ["a string"]}.get(
        annotation, [getattr(annotation, "__name__", str(annotation))]
    )


def _bounds(field: FieldInfo) -> str:
    for meta in field.metadata:
        if isinstance(meta, Gt):
            return f" (> {meta.gt})"
        if isinstance(meta, Ge):
            return f" (≥ {meta.ge})"
    return ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _table(model: type[BaseModel], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| key | default | allowed |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        allowed = ", ".join(dict.fromkeys(_type(field.annotation))) + _bounds(field)
        notes = [n for n in (field.description, NOTES.get(f"{prefix}{name}")) if n]
        text = allowed + ("; " + "; ".join(notes) if notes else "")
        text = text.replace("|", "\\|")  # a pipe inside a cell ends it
        default = DEFAULTS.get(f"{prefix}{name}") or _default(field)
        rows.append(f"| `{name}` | {default} | {text} |")
    return rows


def builtin_workloads() -> list[str]:
    """The workloads mgpu itself ships (plugins live in their own packages and docs)."""
    return [name for name in workload_names() if get_workload_class(name).__module__.startswith("mgpu.")]


def jobs_markdown() -> str:
    """The text of ``docs/jobs.md``."""
    params = {name: get_workload_class(name).Params for name in builtin_workloads()}
    known = {
        f"{p}{k}" for p, m in (("", Job), ("cluster.", ClusterSpec), ("scale.", ScaleSpec)) for k in m.model_fields
    }
    known |= {f"{w}.{k}" for w, m in params.items() for k in m.model_fields}
    stale = sorted((set(NOTES) | set(DEFAULTS)) - known)
    if stale:
        raise KeyError(f"mgpu.docs names keys the models do not have: {', '.join(stale)}")
    out = [
        "# Job files",
        "",
        "<!-- Generated by `python -m mgpu.docs > docs/jobs.md` from the job models; do not edit by hand. -->",
        "",
        "A job file is YAML: a workload, its `params`, and where to run it (`cluster`). Every",
        "key but `workload` (and the sizes a workload needs) has a default; an unknown key is an",
        "error that lists the allowed ones. `--set KEY=VALUE` on the command line sets any key by",
        "its dotted path (`--set params.m=4096`, `--set cluster.devices=[0,1]`).",
        "",
        "Sizes are written the same way everywhere: an integer is bytes, a number in (0, 1] a",
        "fraction of the device's memory, a string such as `40GB` or `512MiB` a size.",
        "",
        "## Top level",
        "",
        *_table(Job, "", skip=("params", "cluster", "scale")),
        "| `params` | | the workload's own keys, below |",
        "| `cluster` | | where and how the job runs, below |",
        "| `scale` | | how `mgpu scale --weak` grows the job, below |",
        "",
        "## `cluster:`",
        "",
        *_table(ClusterSpec, "cluster."),
        "",
        "## `scale:`",
        "",
        *_table(ScaleSpec, "scale."),
    ]
    for name, model in params.items():
        out += ["", f"## `params:` of `{name}`", "", *_table(model, f"{name}.")]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(jobs_markdown(), end="")
