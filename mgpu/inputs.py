"""One input model for every workload: each operand a seeded random array, an ``.npy`` file or a Zarr store.

A workload's parameters subclass :class:`InputParams` and name their operands, each with
the parameters that give its sizes (matmul: ``a`` is ``(m, k)``, ``b`` is ``(k, n)``).
``input: random`` makes every operand from the seed (the sizes and ``dtype`` are then
parameters of the job); ``input: {a: a.npy, b: b.zarr}`` reads them from files or Zarr
stores (:mod:`mgpu.worker.stores`), whose headers (metadata) are read once, on the client, when the job is validated: their shapes give the
sizes and must agree with each other and with any size the job gives, as must their
dtypes. The workers read the files at the paths found then, and never read a header again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from .worker.sources import NpyInfo, NpySource, RandomSource, inspect_npy
from .worker.stores import ZarrInfo, ZarrSource, inspect_zarr, is_zarr_path

__all__ = ["InputParams", "Operand"]


@dataclass(frozen=True)
class Operand:
    """An input of a workload: its key under ``input:`` and the parameters naming its sizes."""

    name: str
    axes: tuple[str, ...]


class InputParams(BaseModel):
    """The ``seed`` and ``input`` of a workload's ``params:``, and the operands they make.

    Subclasses set ``input_operands`` (in random-stream order: the first is stream 0) and declare
    a ``dtype`` field and an int field for every axis an operand names, each None by default
    until validation sets it from the input files (or, for ``dtype``, ``default_dtype``).
    """

    model_config = ConfigDict(extra="forbid")

    input_operands: ClassVar[tuple[Operand, ...]] = ()
    default_dtype: ClassVar[str] = "float32"

    # The generator keys its streams by the seed modulo 2**64: a larger seed would repeat a smaller one's data.
    seed: int = Field(0, ge=0, lt=2**64)
    input: Literal["random"] | dict[str, str] = "random"
    _files: dict[str, NpyInfo | ZarrInfo] = PrivateAttr(default_factory=dict)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if value == "random":
            return value
        names = [op.name for op in cls.input_operands]
        listing = ", ".join(f"{n}: {n}.npy" for n in names)
        if not isinstance(value, dict):
            raise ValueError(f"expected 'random' or the files {{{listing}}} (.npy files or .zarr stores)")
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; allowed: {', '.join(names)}")
        missing = sorted(set(names) - set(value))
        if missing:
            raise ValueError(f"missing {missing[0]!r}; give {' and '.join(names)}")
        if not all(isinstance(path, str) for path in value.values()):
            raise ValueError(f"expected a path for each of {', '.join(names)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        # A size or dtype written null is one not given: the files (or the defaults) set it.
        if isinstance(data, dict):
            settable = {axis for op in cls.input_operands for axis in op.axes} | {"dtype"}
            return {k: v for k, v in data.items() if not (v is None and k in settable)}
        return data

    @model_validator(mode="after")
    def _bind_inputs(self) -> InputParams:
        if self.input == "random":
            for op in self.input_operands:
                for axis in op.axes:
                    if getattr(self, axis) is None:
                        raise ValueError(f"{axis}: required when input is random")
            self.dtype = getattr(self, "dtype", None) or self.default_dtype
            return self
        files = {op.name: _inspect(self.input[op.name], key=f"input.{op.name}") for op in self.input_operands}
        for op in self.input_operands:
            info = files[op.name]
            if len(info.shape) != len(op.axes):
                raise ValueError(
                    f"input.{op.name}: expected a {len(op.axes)}-D array, {info.path!r} has shape {info.shape}"
                )
        first = self.input_operands[0]
        for op in self.input_operands[1:]:
            if files[op.name].dtype != files[first.name].dtype:
                raise ValueError(
                    f"input: {first.name} holds {files[first.name].dtype} and {op.name} holds "
                    f"{files[op.name].dtype}; they must match"
                )
        sizes: dict[str, tuple[int, Operand, int]] = {}  # axis -> (size, operand, axis index)
        for op in self.input_operands:
            for i, axis in enumerate(op.axes):
                size = files[op.name].shape[i]
                if axis not in sizes:
                    sizes[axis] = (size, op, i)
                    continue
                want, other, j = sizes[axis]
                if size != want:
                    raise ValueError(
                        f"input: {other.name} is {files[other.name].shape} and {op.name} is {files[op.name].shape}; "
                        f"{other.name}'s axis {j} and {op.name}'s axis {i} are both {axis} and must be equal"
                    )
        for key, value in [*((axis, s[0]) for axis, s in sizes.items()), ("dtype", files[first.name].dtype)]:
            given = getattr(self, key)
            if given is not None and given != value:
                raise ValueError(f"{key}: {given} disagrees with the input files ({value})")
            setattr(self, key, value)
        self.input = {name: info.path for name, info in files.items()}
        self._files = files
        return self

    def shape_of(self, operand: str) -> tuple[int, ...]:
        """The shape of ``operand`` (from the job's sizes, which the files set)."""
        op = next(o for o in self.input_operands if o.name == operand)
        return tuple(getattr(self, axis) for axis in op.axes)

    def sources(self) -> tuple[RandomSource | NpySource | ZarrSource, ...]:
        """Each operand's source, in ``input_operands`` order: random from the seed, or its file."""
        if self.input == "random":
            return tuple(
                RandomSource(self.seed, i, self.shape_of(op.name), self.dtype)
                for i, op in enumerate(self.input_operands)
            )
        files = self._files or {
            op.name: _inspect(self.input[op.name], key=f"input.{op.name}") for op in self.input_operands
        }
        return tuple(_source(files[op.name]) for op in self.input_operands)

    def chunks_of(self, operand: str) -> tuple[int, ...] | None:
        """The chunk shape of ``operand``'s store, where it is one (tiles then fall on its chunks)."""
        info = self._files.get(operand) if self.input != "random" else None
        return info.chunks if isinstance(info, ZarrInfo) else None


def _inspect(path: str, *, key: str) -> NpyInfo | ZarrInfo:
    """The header of an ``.npy`` file or the metadata of a Zarr store."""
    return inspect_zarr(path, key=key) if is_zarr_path(path) else inspect_npy(path, key=key)


def _source(info: NpyInfo | ZarrInfo) -> NpySource | ZarrSource:
    return ZarrSource(info) if isinstance(info, ZarrInfo) else NpySource(info)
