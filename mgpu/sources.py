"""Inputs and outputs of tiles, read and written by the workers themselves.

Sources: counter-based random operands (any block, regenerated anywhere, the same
values on CPU and GPU) and ``.npy`` files, read on GPUs with ``pread`` or through memory
maps (``mgpu.transfer.read``) and on CPUs through memory maps. Sinks: an ``.npy``
that the client creates empty under a temporary name, the workers fill tile by tile,
and the client renames once the job has passed, so a failed or cancelled job leaves
nothing under the output's name.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import kernels, transfer
from .device import Device
from .errors import JobInputError

__all__ = ["NpyInfo", "NpySink", "NpySource", "RandomSource", "check_output_path", "inspect_npy"]

FLOAT_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class RandomSource:
    """Operand ``operand`` of seed ``seed``: a 2-D (rows x cols) or 1-D (cols) array."""

    seed: int
    operand: int
    shape: tuple[int, ...]
    dtype: str

    def read_into(self, dev: Device, out: Any, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> None:
        """The block into ``out``, an array of its shape on ``dev``."""
        block = self.read(dev, rows, cols)
        with dev.on_stream():
            out[...] = block

    def read(self, dev: Device, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        """The block ``[rows, cols]`` (for a 1-D operand, ``rows`` is the element range)."""
        with dev.on_stream():
            if len(self.shape) == 1:
                block = kernels.random_block(
                    dev.xp,
                    seed=self.seed,
                    operand=self.operand,
                    rows=(0, 1),
                    cols=rows,
                    total_cols=self.shape[0],
                    dtype=self.dtype,
                )
                return block.reshape(-1)
            return kernels.random_block(
                dev.xp,
                seed=self.seed,
                operand=self.operand,
                rows=rows,
                cols=cols,
                total_cols=self.shape[1],
                dtype=self.dtype,
            )


@dataclass(frozen=True)
class NpyInfo:
    """What a ``.npy`` header says, read without loading the data."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    offset: int | None = None  # of the data; None unless C-ordered in native byte order (raw reads)


def inspect_npy(path: str | Path, *, key: str) -> NpyInfo:
    """Read an ``.npy`` file's header; ``key`` names the job key in any error."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{key}: file {str(path)!r} does not exist")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # numpy raises several types for a bad header
        raise ValueError(f"{key}: {str(path)!r} is not a readable .npy file ({e})") from None
    if arr.dtype.name not in FLOAT_DTYPES:
        raise ValueError(f"{key}: {str(path)!r} holds {arr.dtype}; allowed: {', '.join(FLOAT_DTYPES)}")
    raw = arr.flags.c_contiguous and arr.dtype.isnative
    return NpyInfo(str(p.resolve()), tuple(int(s) for s in arr.shape), arr.dtype.name, arr.offset if raw else None)


@dataclass(frozen=True)
class NpySource:
    """An operand in an ``.npy`` file; each task reads its block from the file."""

    info: NpyInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def view(self, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> np.ndarray:
        """The block as a view of the file's memory map (nothing read yet)."""
        mm = np.load(self.info.path, mmap_mode="r")
        return mm[rows[0] : rows[1]] if cols is None else mm[rows[0] : rows[1], cols[0] : cols[1]]

    def _block(self, dev: Device, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        """What :func:`mgpu.transfer.load` reads the block from: on a GPU the file itself
        (where :func:`mgpu.transfer.read_method` says pread and the file's bytes are the
        array's), else :meth:`view` (on a CPU the copy from the map is all the read there is)."""
        width = self.info.shape[1] if len(self.info.shape) == 2 else None
        contiguous = cols is None or width is None or (cols[0], cols[1]) == (0, width)
        if transfer.read_method(contiguous) == "pread" and dev.is_gpu and self.info.offset is not None:
            return transfer.FileBlock(
                self.info.path, self.info.offset, self.info.shape, np.dtype(self.info.dtype), rows, cols
            )
        return self.view(rows, cols)

    def read(self, dev: Device, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        """The block on ``dev``, staged through pinned memory (see :mod:`mgpu.transfer`)."""
        return transfer.load(dev, self._block(dev, rows, cols))

    def read_into(self, dev: Device, out: Any, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> None:
        """The block into ``out``, a C-contiguous array of its shape on ``dev``."""
        transfer.load(dev, self._block(dev, rows, cols), out)


def check_output_path(path: str | Path, *, key: str, suffix: str, force: bool) -> str:
    """Validate an output path before anything starts; returns it absolute.

    Raises
    ------
    JobInputError
        If the suffix is wrong, the folder is missing, or the file exists without ``force``.
    """
    p = Path(path).expanduser()
    if p.suffix != suffix:
        raise JobInputError(f"{key}: {str(path)!r} must end in {suffix}")
    if not p.parent.is_dir():
        raise JobInputError(f"{key}: the folder {str(p.parent)!r} does not exist")
    if p.exists() and not force:
        raise JobInputError(f"{key}: {str(path)!r} already exists; remove it or pass --force")
    return str(p.resolve())


@dataclass(frozen=True)
class NpySink:
    """An output ``.npy`` written tile by tile under a temporary name, renamed on success."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    partial: str = ""
    keep: bool = True  # False: scratch for a later step (a PNG), removed at the end

    @classmethod
    def for_path(cls, path: str, shape: tuple[int, ...], dtype: str, *, keep: bool = True) -> NpySink:
        p = Path(path)
        partial = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.partial")
        return cls(path, tuple(shape), dtype, str(partial), keep)

    def create(self) -> None:
        """Write the header and size the file (sparse) so workers can map it."""
        mm = np.lib.format.open_memmap(self.partial, mode="w+", dtype=self.dtype, shape=self.shape)
        del mm

    def write(self, index: tuple[slice, ...], block: Any, dev: Device | None = None) -> None:
        """Write ``block`` (on ``dev``, or a host array) at ``index`` of the file.

        Through the shared memory map, the page cache holds the bytes for every process at
        once; nothing is synced to disk here (the rename on success publishes the file).
        """
        try:
            mm = np.load(self.partial, mmap_mode="r+")
        except FileNotFoundError:
            # Gone only once the job was given up (failed or stopped) while this tile
            # still ran: there is nothing left to write into.
            return
        if dev is None:
            mm[index] = block
        else:
            transfer.store(dev, mm[index], block)
        del mm

    def commit(self) -> None:
        """Publish the finished file under its name (or drop it if it was scratch)."""
        if self.keep:
            os.replace(self.partial, self.path)
        else:
            self.discard()

    def discard(self) -> None:
        try:
            os.unlink(self.partial)
        except FileNotFoundError:
            pass
