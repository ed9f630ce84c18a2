"""Inputs and outputs of tiles, read and written by the workers themselves.

Sources: counter-based random operands (any block, regenerated anywhere, the same
values on CPU and GPU) and ``.npy`` files, read on GPUs by KvikIO (whole rows) or
through memory maps (column blocks; ``mgpu.io.read``) and on CPUs through memory maps. Sinks: an ``.npy``
that the client creates empty under a temporary name, the workers fill tile by tile,
and the client renames once the job has passed, so a failed or cancelled job leaves
nothing under the output's name.
"""

from __future__ import annotations

import errno
import math
import os
import resource
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import JobFailed, JobInputError
from ..paths import check_writable, publish
from ..sizes import format_bytes
from . import io, kernels, transfer
from .device import Device

if TYPE_CHECKING:
    from .stores import ZarrSink

__all__ = [
    "FileStamp",
    "InputChanged",
    "NpyInfo",
    "NpySink",
    "NpySource",
    "RandomSource",
    "check_output_path",
    "check_output_room",
    "free_bytes",
    "inspect_npy",
]

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
                cols=cols or (0, self.shape[1]),  # no cols: whole rows
                total_cols=self.shape[1],
                dtype=self.dtype,
            )


class InputChanged(RuntimeError):
    """An input file changed (truncated, rewritten or replaced) while a job read it."""


@dataclass(frozen=True)
class FileStamp:
    """Which file a path named when its header was read: its inode, size and modification time."""

    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class NpyInfo:
    """What a ``.npy`` header says, read without loading the data; ``key`` names the job key
    of the file and ``stamp`` the file read (see :meth:`check`)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    offset: int | None = None  # of the data; None unless C-ordered in native byte order (raw reads)
    key: str = "input"
    stamp: FileStamp | None = None

    def check(self) -> None:
        """Raise :class:`InputChanged`, naming the key and the file, if the file is not the
        one whose header was read (on the client, before the job started).

        Tasks check before they read: a file truncated under a memory map would kill the
        worker (SIGBUS), and one rewritten or replaced would give a wrong answer.
        """
        if self.stamp is None:
            return
        try:
            now = FileStamp.of(self.path)
        except FileNotFoundError:
            raise InputChanged(f"{self.key}: {self.path} was removed while the job read it") from None
        if now.inode != self.stamp.inode:
            what = "replaced by another file"
        elif now.size != self.stamp.size:
            shorter = now.size < self.stamp.size
            what = f"{'truncated' if shorter else 'extended'} to {now.size:,} bytes from {self.stamp.size:,}"
        elif now.mtime_ns != self.stamp.mtime_ns:
            what = "rewritten"
        else:
            return
        raise InputChanged(f"{self.key}: {self.path} was {what} while the job read it; the job's answer would be wrong")


def inspect_npy(path: str | Path, *, key: str) -> NpyInfo:
    """Read an ``.npy`` file's header; ``key`` names the job key in any error."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{key}: file {str(path)!r} does not exist")
    if p.is_dir():
        raise ValueError(f"{key}: {str(path)!r} is a directory; give an .npy file")
    if not p.is_file():
        raise ValueError(f"{key}: {str(path)!r} is not a regular file (a FIFO or device?); give an .npy file")
    try:
        with open(p, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise ValueError(f"{key}: {str(path)!r} cannot be read: {e.strerror}") from None
    if magic != b"\x93NUMPY":
        raise ValueError(
            f"{key}: {str(path)!r} is not an .npy file (it lacks the NumPy header); write it with numpy.save"
        )
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # numpy raises several types for a bad header
        raise ValueError(f"{key}: {str(path)!r} is not a readable .npy file ({e})") from None
    if arr.dtype.name not in FLOAT_DTYPES:
        raise ValueError(f"{key}: {str(path)!r} holds {arr.dtype}; allowed: {', '.join(FLOAT_DTYPES)}")
    raw = arr.flags.c_contiguous and arr.dtype.isnative
    return NpyInfo(
        str(p.resolve()),
        tuple(int(s) for s in arr.shape),
        arr.dtype.name,
        arr.offset if raw else None,
        key,
        FileStamp.of(p),
    )


@dataclass(frozen=True)
class NpySource:
    """An operand in an ``.npy`` file; each task reads its block from the file."""

    info: NpyInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def view(self, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> np.ndarray:
        """The block as a view of the file's memory map (nothing read yet)."""
        self.info.check()
        mm = np.load(self.info.path, mmap_mode="r")
        return mm[rows[0] : rows[1]] if cols is None else mm[rows[0] : rows[1], cols[0] : cols[1]]

    def kvikio_range(self, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """``(offset, bytes)`` of the block in the file where a GPU reads it with KvikIO
        (see :func:`mgpu.worker.io.read_method`: the block is one range of the file and the file's
        bytes are the array's); else None."""
        self.info.check()  # a GPU's reads come here first: the file must be the one checked
        info = self.info
        width = info.shape[1] if len(info.shape) == 2 else 1
        contiguous = cols is None or (cols[0], cols[1]) == (0, width)
        if info.offset is None or io.read_method(contiguous) != "kvikio":
            return None
        if cols is not None and not contiguous:
            raise ValueError(
                f"mgpu.io.read: kvikio reads whole rows only; {info.path!r} columns {cols[0]}:{cols[1]} "
                "are a block of many ranges (use auto or mmap)"
            )
        itemsize = np.dtype(info.dtype).itemsize
        return info.offset + rows[0] * width * itemsize, (rows[1] - rows[0]) * width * itemsize

    def warm_up(self, dev: Device, *, contiguous: bool) -> None:
        """On a GPU worker, make what the first read of a block of this file (whole rows or
        not) would otherwise pay for: KvikIO's pool and bounce buffers, or the stager's
        pinned buffers (32 cudaHostAlloc calls, two a host thread)."""
        where = self.kvikio_range((0, self.info.shape[0]), None) if contiguous else None
        if where is None:
            dev.staging.ready_buffers()
        else:
            io.warm_up(self.info.path, *where)

    def read(self, dev: Device, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        """The block on ``dev`` (see :meth:`read_into`)."""
        if not dev.is_gpu:
            return np.ascontiguousarray(self.view(rows, cols))
        width = self.info.shape[1] if len(self.info.shape) == 2 else None
        shape: tuple[int, ...] = (rows[1] - rows[0],)
        if width is not None:
            c0, c1 = cols or (0, width)
            shape = (rows[1] - rows[0], c1 - c0)
        with dev.on_stream():
            out = dev.xp.empty(shape, self.info.dtype)
        self.read_into(dev, out, rows, cols)
        return out

    def read_into(self, dev: Device, out: Any, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> None:
        """The block into ``out``, a C-contiguous array of its shape on ``dev``.

        On a GPU, a block that is one range of the file is read by KvikIO, after a wait
        for this thread's stream (the last user of ``out``'s memory: KvikIO copies on
        streams of its own); any other block is copied from a memory map through pinned
        buffers (:mod:`mgpu.worker.transfer`), in order on the stream. On a CPU the copy from the
        map is all the read there is.
        """
        where = self.kvikio_range(rows, cols) if dev.is_gpu else None
        if where is None:
            transfer.load(dev, self.view(rows, cols), out)
            return
        dev.synchronize()
        seconds = io.read(self.info.path, where[0], out)
        dev.count_read("h2d", where[1], seconds)


def check_output_path(path: str | Path, *, key: str, suffix: str, force: bool) -> str:
    """Validate an output path before anything starts; returns it absolute.

    Raises
    ------
    JobInputError
        If the suffix is wrong, the path cannot be written (see :func:`mgpu.paths.check_writable`),
        or the file exists without ``force``.
    """
    p = Path(path).expanduser()
    if p.suffix != suffix:
        raise JobInputError(f"{key}: {str(path)!r} must end in {suffix}")
    # A Zarr store is a folder: one that exists is the store itself, replaced with force.
    return check_writable(p, key=key, force=force, folder=suffix == ".zarr")


def _npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    """The ``.npy`` header (format 1.0) of a C-ordered array of ``shape`` and ``dtype``."""
    buf = BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def reserve(f: Any, nbytes: int, *, key: str, path: str, total: int) -> None:
    """Size the open file ``f`` to ``nbytes`` and reserve its blocks, so that a full disk
    fails now, naming ``key`` and ``path`` (``total``: the whole output's bytes), rather
    than as a fault in a write mid-job. Filesystems that cannot reserve are let be."""
    f.truncate(nbytes)
    try:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise JobFailed(
                f"{key}: could not reserve {format_bytes(total)} for {path} ({e.strerror}); nothing was kept"
            ) from None


@dataclass(frozen=True)
class NpySink:
    """An output ``.npy`` written tile by tile under a temporary name, renamed on success.

    ``key`` is the job key that names the file (named in any error about it).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    partial: str = ""
    keep: bool = True  # False: scratch for a later step (a PNG), removed at the end
    key: str = "params.output"
    offset: int = 0  # of the data in the file: the header's length

    @classmethod
    def for_path(
        cls, path: str, shape: tuple[int, ...], dtype: str, *, keep: bool = True, key: str = "params.output"
    ) -> NpySink:
        p = Path(path)
        partial = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.partial")
        shape = tuple(int(s) for s in shape)
        return cls(path, shape, dtype, str(partial), keep, key, len(_npy_header(shape, dtype)))

    @property
    def nbytes(self) -> int:
        """The file's size once written: header and data."""
        return self.offset + math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def create(self) -> None:
        """Write the header, size the file and reserve its blocks, so workers can map it.

        The blocks are reserved now because the workers write through memory maps: a
        disk that filled mid-job would kill them (SIGBUS) on a page of a sparse file; a
        reservation that fails here fails the job at once, naming the file. Nothing is
        mapped here: an output larger than this process's address space (a ``ulimit -v``)
        is still created, and each write maps only its own rows.

        Raises
        ------
        JobFailed
            If the filesystem cannot hold the file (it filled since the job was checked).
        """
        with open(self.partial, "xb") as f:
            f.write(_npy_header(self.shape, self.dtype))
            reserve(f, self.nbytes, key=self.key, path=self.path, total=self.nbytes)

    def write(self, index: tuple[slice, ...], block: Any, dev: Device | None = None) -> None:
        """Write ``block`` (on ``dev``, or a host array) at ``index`` of the file.

        Whole rows are one range of the file: with ``mgpu.io.write: pwrite`` they are
        handed to the kernel, from a GPU through pinned buffers (see
        :meth:`~mgpu.worker.transfer.Stager.write`); other blocks, and every block by
        default (``mmap``), are copied into a memory map of the file. Either way the page cache holds
        the bytes for every process at once; nothing is synced to disk here (the rename on
        success publishes the file).
        """
        r0, r1, _ = index[0].indices(self.shape[0])
        if r1 <= r0:
            return
        row_bytes = math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize
        if _whole_rows(index, self.shape) and io.write_method() == "pwrite":
            self._pwrite(self.offset + r0 * row_bytes, block, dev)
            return
        if dev is not None and dev.is_gpu and _whole_rows(index, self.shape) and io.write_method() == "kvikio":
            # Whole rows are one range of the file: KvikIO's threads write its pieces at once.
            if not block.flags.c_contiguous:
                block = dev.xp.ascontiguousarray(block)
            dev.synchronize()  # KvikIO copies on streams of its own: the block must be made
            try:
                seconds = io.write(self.partial, self.offset + r0 * row_bytes, block)
            except Exception:
                if not os.path.exists(self.partial):
                    return  # given up while this tile ran (see below)
                raise
            dev.count_read("d2h", block.nbytes, seconds)
            return
        try:
            # The tile's rows only: a map of the whole file could exceed the address space.
            mm = np.memmap(
                self.partial,
                dtype=self.dtype,
                mode="r+",
                offset=self.offset + r0 * row_bytes,
                shape=(r1 - r0, *self.shape[1:]),
            )
        except FileNotFoundError:
            # Gone only once the job was given up (failed or stopped) while this tile
            # still ran: there is nothing left to write into.
            return
        rest = (slice(None), *index[1:])
        if dev is None:
            mm[rest] = block
        else:
            transfer.store(dev, mm[rest], block)
        # A band's map is GiBs: unmapped at once, it would hold the map lock that the other
        # threads' page faults (the next blocks' loads) wait on.
        transfer.drop_pages(mm)
        del mm

    def _pwrite(self, offset: int, block: Any, dev: Device | None) -> None:
        """``block`` into the file from byte ``offset`` by ``os.pwrite``."""
        try:
            fd = os.open(self.partial, os.O_WRONLY)
        except FileNotFoundError:
            return  # given up while this tile ran (see write)
        try:
            if dev is not None and dev.is_gpu:
                if not block.flags.c_contiguous:
                    with dev.on_stream():
                        block = dev.xp.ascontiguousarray(block)
                transfer.Stager(dev).write(fd, offset, block)
            else:
                transfer.pwrite_all(fd, np.ascontiguousarray(block, dtype=self.dtype), offset)
        finally:
            os.close(fd)

    def allocate(self, rows: tuple[int, int]) -> None:
        """Make rows ``rows`` of the file ready for their writes now (``posix_fallocate``
        over them again): the reservation (:meth:`create`) gives a tmpfs file its pages
        but leaves each to be cleared on its first use, which a second ``fallocate`` does.
        Written later, the rows are copied into pages ready for them."""
        try:
            offset = np.load(self.partial, mmap_mode="r").offset
            row = int(np.prod(self.shape[1:], dtype=np.int64)) * np.dtype(self.dtype).itemsize
            fd = os.open(self.partial, os.O_RDWR)
        except (FileNotFoundError, ValueError):
            return  # gone: the job was given up
        try:
            os.posix_fallocate(fd, offset + rows[0] * row, (rows[1] - rows[0]) * row)
        except OSError:
            pass  # not on this file system: the pages come as they are written
        finally:
            os.close(fd)

    def commit(self) -> None:
        """Publish the finished file under its name (or drop it if it was scratch)."""
        if self.keep:
            publish(self.partial, self.path)
        else:
            self.discard()

    def discard(self) -> None:
        try:
            os.unlink(self.partial)
        except FileNotFoundError:
            pass


def _whole_rows(index: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``index`` takes every column of each row it takes (one range of the file)."""
    return all(i.indices(n) == (0, n, 1) for i, n in zip(index[1:], shape[1:], strict=False))


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged process may still write in ``folder``'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _largest_file(folder: str) -> int | None:
    """The largest file ``folder``'s filesystem holds, where it says (``FILESIZEBITS``)."""
    try:
        bits = os.pathconf(folder, "PC_FILESIZEBITS")
    except (OSError, ValueError):
        return None
    # glibc answers 32 for a filesystem it does not know (tmpfs in some VMs holds far
    # larger files), so only a figure above that is taken as the filesystem's own.
    return (1 << (bits - 1)) - 1 if 32 < bits < 64 else None


def check_output_room(sinks: Sequence[NpySink | ZarrSink]) -> None:
    """Refuse outputs their filesystem cannot take, before anything is written.

    Each file must fit this process's file-size limit (``ulimit -f``, inherited by the
    workers it starts) and the filesystem's; the files of one filesystem together must
    fit its free space (they are sparse until the workers fill them, so a check after
    creating them would pass and the disk fill mid-job).

    Raises
    ------
    JobInputError
        Naming the output's key, its size and what the filesystem or limit allows.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    by_fs: dict[int, list[NpySink | ZarrSink]] = {}
    for sink in sinks:
        folder = os.path.dirname(sink.partial)
        size = format_bytes(sink.nbytes)
        if soft != resource.RLIM_INFINITY and sink.nbytes > soft:
            raise JobInputError(
                f"{sink.key}: {sink.path} would be {size}, over this process's file-size limit "
                f"(ulimit -f) of {format_bytes(soft)}; write a smaller output or raise the limit"
            )
        largest = _largest_file(folder)
        if largest is not None and sink.nbytes > largest:
            raise JobInputError(
                f"{sink.key}: {sink.path} would be {size}, larger than the filesystem of {folder} "
                f"holds ({format_bytes(largest)} a file); write it elsewhere or make the job smaller"
            )
        by_fs.setdefault(os.stat(folder).st_dev, []).append(sink)
    for group in by_fs.values():
        folder = os.path.dirname(group[0].partial)
        need, free = sum(s.nbytes for s in group), free_bytes(folder)
        if need > free:
            keys = ", ".join(dict.fromkeys(s.key for s in group))
            what = " and ".join(f"{s.path} ({format_bytes(s.nbytes)})" for s in group)
            raise JobInputError(
                f"{keys}: {what} {'need' if len(group) > 1 else 'needs'} {format_bytes(need)} but the "
                f"filesystem of {folder} has {format_bytes(free)} free; free space, write elsewhere, "
                "or make the job smaller"
            )
