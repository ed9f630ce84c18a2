"""Zarr arrays as inputs and outputs of tiles, read and written by the workers themselves.

A Zarr array is a folder of chunks, one object each, and metadata (``zarr.json``, or
``.zarray`` for Zarr 2). Where a chunk is stored uncompressed (its only codec the bytes
codec, in this machine's byte order, no sharding) its object is the chunk's C-ordered
bytes, and mgpu reads and writes it as it does an ``.npy`` file: on a GPU worker, the
rows of a chunk that are whole rows of a block (the chunk as wide as the block) are read
by KvikIO straight into place, and any other piece is copied from a memory map of its
chunk rows, its own columns only, through the pinned stager (as a column block of an
``.npy`` is), all of a block's pieces at once (:func:`block_reads`); a CPU worker copies
them out of the file. A compressed chunk is decoded on the host by zarr, once for every
block that meets it and ahead of the blocks the streamed matmul reads next
(:mod:`mgpu.worker.decoded`), and its pieces reach a GPU through the pinned stager
(:mod:`mgpu.worker.transfer`): zarr's GPU buffers would copy the bytes the same way, after
decoding them on the host.

An output is made by the client under a temporary name before any task: its metadata
(uncompressed chunks of whole rows) and every chunk's object at full size, so the
workers write the bytes of their tiles into the objects at once, tiles that share a
chunk included, and nothing is decoded and written back. The client renames the folder
once the job has passed; a failed or stopped job leaves no store under the output's name.

zarr is an extra (``pip install 'mgpu[zarr]'``): without it a job naming a store is
refused before anything starts.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import JobInputError, StoreUnreadable
from ..paths import publish, remove
from ..tiling import split_by_size
from . import io, transfer
from .decoded import DecodedChunks
from .device import Device
from .sources import NpySink, check_output_path, reserve

__all__ = [
    "OUTPUT_CHUNK_BYTES",
    "ChunkRead",
    "StoreUnreadable",
    "ZarrInfo",
    "ZarrSink",
    "ZarrSource",
    "block_reads",
    "chunk_pieces",
    "on_chunks",
    "ranges_on",
    "inspect_zarr",
    "is_zarr_path",
    "output_sink",
    "require_zarr",
]

FLOAT_DTYPES = ("float16", "float32", "float64")
# Rows per chunk of an output: about this many bytes each (a tile's write spans few objects,
# and a reader such as dask.array.from_zarr gets chunks of the size it likes).
OUTPUT_CHUNK_BYTES = 64 << 20
# Chunk maps a source keeps (each holds a file descriptor): the chunks of a few blocks.
_KEPT_MAPS = 128


def require_zarr(key: str) -> Any:
    """The ``zarr`` module, or JobInputError naming ``key`` and the extra that installs it."""
    try:
        import zarr
    except ImportError:
        raise JobInputError(
            f"{key}: reading and writing Zarr stores needs the zarr package: pip install 'mgpu[zarr]'"
        ) from None
    return zarr


def is_zarr_path(path: str | Path) -> bool:
    """Whether ``path`` names a Zarr store: it ends in ``.zarr``, or is a folder with Zarr metadata."""
    p = Path(path).expanduser()
    if p.name.endswith(".zarr"):
        return True
    return p.is_dir() and any((p / name).exists() for name in ("zarr.json", ".zarray"))


@dataclass(frozen=True)
class ZarrInfo:
    """What a store's metadata says, read once on the client.

    ``raw``: every chunk is stored as its bytes (see the module's docstring), so
    ``chunk_path`` names the object a chunk's bytes are in; else zarr decodes the chunks.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    raw: bool
    fill_value: float = 0.0
    key: str = "input"
    prefix: str = "c/"  # before the chunk's coordinates in its key: "c/" (Zarr 3), "" (Zarr 2)
    separator: str = "/"

    def chunk_path(self, coords: tuple[int, ...]) -> str:
        """The file holding chunk ``coords``."""
        name = self.prefix + self.separator.join(str(c) for c in coords)
        return os.path.join(self.path, *name.split("/"))

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * np.dtype(self.dtype).itemsize

    @property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each axis."""
        return tuple(math.ceil(s / c) for s, c in zip(self.shape, self.chunks, strict=True))


def _raw_layout(arr: Any) -> tuple[str, str] | None:
    """(prefix, separator) of the chunks' keys when ``arr``'s chunks are stored as their
    bytes in native order; None when zarr must decode them."""
    meta = arr.metadata
    native = "little" if sys.byteorder == "little" else "big"
    if meta.zarr_format == 2:
        if arr.compressors or arr.filters or arr.order != "C":
            return None
        if arr.dtype.itemsize > 1 and arr.dtype.byteorder not in ("=", "|", "<" if native == "little" else ">"):
            return None
        return "", getattr(meta, "dimension_separator", ".") or "."
    if arr.shards is not None or arr.compressors or arr.filters:
        return None
    serializer = arr.serializer
    endian = getattr(getattr(serializer, "endian", None), "value", None)
    if type(serializer).__name__ != "BytesCodec" or (endian is not None and endian != native):
        return None
    encoding = meta.chunk_key_encoding
    name = getattr(encoding, "name", None)
    separator = getattr(encoding, "separator", "/")
    if name == "default":
        return "c" + separator, separator
    if name == "v2":
        return "", separator
    return None


def inspect_zarr(path: str | Path, *, key: str) -> ZarrInfo:
    """Read a store's metadata (and, for uncompressed chunks, each chunk's size);
    ``key`` names the job key in any error.

    Raises
    ------
    JobInputError
        If zarr is not installed.
    ValueError
        If the store is missing, is not a Zarr array, holds a dtype mgpu does not take,
        or has a chunk whose size is not an uncompressed chunk's (a message naming ``key``).
    """
    zarr = require_zarr(key)
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{key}: store {str(path)!r} does not exist")
    try:
        arr = zarr.open_array(str(p), mode="r")
    except Exception as e:  # zarr raises several types for a folder that is no array
        raise ValueError(f"{key}: {str(path)!r} is not a readable Zarr array ({type(e).__name__}: {e})") from None
    dtype = np.dtype(arr.dtype)
    if dtype.name not in FLOAT_DTYPES:
        raise ValueError(f"{key}: {str(path)!r} holds {dtype}; allowed: {', '.join(FLOAT_DTYPES)}")
    layout = _raw_layout(arr)
    fill = arr.fill_value
    info = ZarrInfo(
        str(p.resolve()),
        tuple(int(s) for s in arr.shape),
        dtype.name,
        tuple(int(c) for c in arr.chunks),
        layout is not None,
        float(fill) if fill is not None else 0.0,
        key,
        *(layout or ("c/", "/")),
    )
    if info.raw:
        _check_raw_chunks(info)
    return info


def _check_raw_chunks(info: ZarrInfo) -> None:
    """Refuse a store whose uncompressed chunk objects are not a chunk's size (a missing
    one is the fill value, as zarr reads it)."""
    want = info.chunk_nbytes
    for coords in itertools.product(*(range(g) for g in info.grid)):
        chunk = info.chunk_path(coords)
        try:
            size = os.stat(chunk).st_size
        except FileNotFoundError:
            continue
        if size != want:
            rel = os.path.relpath(chunk, info.path)
            raise ValueError(
                f"{info.key}: chunk {rel} of {info.path} holds {size:,} bytes where an uncompressed chunk "
                f"of {info.chunks} {info.dtype} holds {want:,}; the store is damaged"
            )


@dataclass(frozen=True)
class Piece:
    """Where one chunk meets a block: the chunk, the ranges inside it and inside the block."""

    coords: tuple[int, ...]
    inner: tuple[tuple[int, int], ...]  # per axis, relative to the chunk's first element
    outer: tuple[tuple[int, int], ...]  # per axis, relative to the block's first element


def chunk_pieces(chunks: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> list[Piece]:
    """The pieces of the block ``box`` (a ``(lo, hi)`` per axis) cut by a chunk grid of
    ``chunks``, in C order of the chunks."""
    per_axis = []
    for (lo, hi), c in zip(box, chunks, strict=True):
        axis = []
        for i in range(lo // c, (hi - 1) // c + 1) if hi > lo else ():
            a0, a1 = max(lo, i * c), min(hi, (i + 1) * c)
            axis.append((i, (a0 - i * c, a1 - i * c), (a0 - lo, a1 - lo)))
        per_axis.append(axis)
    return [
        Piece(tuple(a[0] for a in combo), tuple(a[1] for a in combo), tuple(a[2] for a in combo))
        for combo in itertools.product(*per_axis)
    ]


@dataclass(frozen=True)
class ChunkRead:
    """How one piece of a block comes from its chunk's object (see :func:`block_reads`).

    ``how``: ``"direct"``, the piece's chunk rows are one range of the object and rows of
    the block, read into place; ``"staged"``, its elements are copied out of a map of its
    chunk rows; ``"fill"``, the chunk has no object (never written: the fill value).
    ``offset`` and ``nbytes``: the piece's chunk rows (every column) in the object.
    """

    piece: Piece
    path: str
    how: Literal["direct", "staged", "fill"]
    offset: int
    nbytes: int


def block_reads(info: ZarrInfo, box: tuple[tuple[int, int], ...]) -> list[ChunkRead]:
    """How each piece of the block ``box`` of an uncompressed store is read, in C order
    of the chunks (see :class:`ChunkRead`).

    A piece is direct where its chunk rows take every column of the chunk (so they are
    one range of its object) and every column of the block (so they are rows of it, one
    range of the block's memory): KvikIO reads them into place. Any other is staged:
    only its own elements are copied, where a read of whole chunk rows would move the
    columns beside them too (half a chunk's bytes for nothing, for a block half a
    chunk wide) and need a device buffer outside the budget to copy them from.
    """
    itemsize = np.dtype(info.dtype).itemsize
    widths = [hi - lo for lo, hi in box]
    out = []
    how: Literal["direct", "staged", "fill"]
    for piece in chunk_pieces(info.chunks, box):
        path = info.chunk_path(piece.coords)
        offset, nbytes = _rows_range(info.chunks, itemsize, piece.inner)
        if not os.path.exists(path):
            how = "fill"
        elif all(
            piece.inner[i] == (0, info.chunks[i]) and piece.outer[i] == (0, widths[i])
            for i in range(1, len(info.chunks))
        ):
            how = "direct"
        else:
            how = "staged"
        out.append(ChunkRead(piece, path, how, offset, nbytes))
    return out


def on_chunks(size: int, *chunks: int | None) -> int:
    """``size`` cut down to a multiple of the chunks given (their least common multiple, or
    else the largest chunk it holds), so tiles of it read whole chunks; ``size`` itself
    where no chunk is given or none fits in it."""
    given = [c for c in chunks if c]
    if not given:
        return size
    for c in (math.lcm(*given), *sorted(given, reverse=True)):
        if c <= size:
            return size // c * c
    return size


def ranges_on(n: int, size: int, chunk: int | None) -> list[tuple[int, int]]:
    """``range(n)`` in pieces of ``size``: where ``size`` is a multiple of ``chunk``, each
    piece starts on a chunk (the last is shorter); else as equal as they can be."""
    if chunk and size % chunk == 0:
        return [(lo, min(lo + size, n)) for lo in range(0, n, size)]
    return split_by_size(n, size)


def _box(shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int] | None) -> tuple[tuple[int, int], ...]:
    if len(shape) == 1:
        return (rows,)
    return (rows, cols or (0, shape[1]))


def _rows_range(info_chunks: tuple[int, ...], itemsize: int, inner: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(offset, bytes) in a chunk's object of the chunk rows ``inner[0]``, every column of them."""
    row = math.prod(info_chunks[1:]) * itemsize
    return inner[0][0] * row, (inner[0][1] - inner[0][0]) * row


def _slices(ranges: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in ranges)


@dataclass(frozen=True)
class ZarrSource:
    """An operand in a Zarr store; each task reads its block from the chunks it meets.

    A source is made for each task (``sources()``), and keeps the maps of the chunks its
    staged reads copied from (see :meth:`_mapped`) and a compressed store's decoded
    chunks (:meth:`ahead`) for its life.
    """

    info: ZarrInfo
    _maps: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    _decoded: list[DecodedChunks] = field(default_factory=list, init=False, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.info,)  # without its maps and decoded chunks

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def kvikio_range(self, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """None: a store's block is no single range of one file (callers then use :meth:`read`)."""
        return None

    def warm_up(self, dev: Device, *, contiguous: bool) -> None:
        """On a GPU worker, start what the first read would otherwise pay for: the stager's
        pinned buffers and, for uncompressed chunks, KvikIO's pool (on the first chunk)."""
        dev.staging.ready_buffers()
        if self.info.raw:
            first = self.info.chunk_path((0,) * len(self.info.shape))
            if os.path.exists(first):
                io.warm_up(first, 0, self.info.chunk_nbytes)

    def read(self, dev: Device, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> Any:
        """The block ``[rows, cols]`` on ``dev`` (for a 1-D operand, ``rows`` is the element range)."""
        box = _box(self.info.shape, rows, cols)
        with dev.on_stream():
            out = dev.xp.empty(tuple(b - a for a, b in box), self.info.dtype)
        self.read_into(dev, out, rows, cols)
        return out

    def read_into(self, dev: Device, out: Any, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> None:
        """The block into ``out``, a C-contiguous array of its shape on ``dev``.

        Raises
        ------
        StoreUnreadable
            If a chunk is missing its bytes or cannot be decoded (the key and chunk named).
        """
        box = _box(self.info.shape, rows, cols)
        if not self.info.raw:
            self._read_decoded(dev, out, box)
        elif dev.is_gpu:
            self._read_raw_gpu(dev, out, box)
        else:
            self._read_raw_host(out, box)

    def _decoder(self, dev: Device) -> DecodedChunks:
        """The store's decoded chunks (decoded on ``dev``'s host threads), kept for the life
        of the source (a task's)."""
        if not self._decoded:
            self._decoded.append(DecodedChunks(self.info, dev.staging.pool_for("decode")))
        return self._decoded[0]

    def ahead(self, dev: Device, blocks: Sequence[tuple[tuple[int, int], tuple[int, int] | None]]) -> None:
        """Start decoding the chunks of the blocks ``(rows, cols)`` to be read next on
        ``dev``, in order, while other work runs (see :mod:`mgpu.worker.decoded`);
        nothing to do for uncompressed chunks."""
        if self.info.raw:
            return
        shape = self.info.shape
        coords = [p.coords for rows, cols in blocks for p in chunk_pieces(self.info.chunks, _box(shape, rows, cols))]
        self._decoder(dev).ahead(coords)

    def _read_decoded(self, dev: Device, out: Any, box: tuple[tuple[int, int], ...]) -> None:
        """Each piece of the block from its chunk decoded on the host, all at once through
        the pinned stager (on a CPU, copied)."""
        pieces = chunk_pieces(self.info.chunks, box)
        chunks = self._decoder(dev).get([p.coords for p in pieces])
        transfer.load_pieces(
            dev,
            [(out[_slices(p.outer)], chunk[_slices(p.inner)]) for p, chunk in zip(pieces, chunks, strict=True)],
            spread=True,
        )

    def _chunk_rows(self, piece: Piece) -> np.ndarray | None:
        """A piece's chunk rows (every column) from the chunk's object; None if it has none."""
        info = self.info
        offset, nbytes = _rows_range(info.chunks, np.dtype(info.dtype).itemsize, piece.inner)
        path = info.chunk_path(piece.coords)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(nbytes)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnreadable(f"{info.key}: chunk {path} could not be read ({e.strerror})") from None
        if len(data) != nbytes:
            raise StoreUnreadable(f"{info.key}: chunk {path} ends {nbytes - len(data):,} bytes short")
        rows = piece.inner[0][1] - piece.inner[0][0]
        return np.frombuffer(data, info.dtype).reshape(rows, *info.chunks[1:])

    def _read_raw_host(self, out: np.ndarray, box: tuple[tuple[int, int], ...]) -> None:
        for piece in chunk_pieces(self.info.chunks, box):
            rows = self._chunk_rows(piece)
            where = _slices(piece.outer)
            if rows is None:
                out[where] = self.info.fill_value
            else:
                out[where] = rows[(slice(None),) + _slices(piece.inner[1:])]

    def _mapped(self, read: ChunkRead) -> np.ndarray:
        """The piece's elements in a memory map of its chunk's object (nothing read yet).

        A chunk's map is kept (the ``_KEPT_MAPS`` last used): the kernel maps 64 KiB of
        pages around each one a copy faults in, so a block half a chunk wide maps the
        other half's pages too, which the next block then finds in place (a 16 MiB half
        of a chunk copied from a fresh map took 2.5 times as long as from one kept). Each
        map holds a file descriptor, so not every chunk of a large store keeps one.
        """
        info = self.info
        mm = self._maps.get(read.path)
        if mm is not None:
            self._maps.move_to_end(read.path)
        else:
            try:
                size = os.stat(read.path).st_size
            except OSError as e:
                raise StoreUnreadable(f"{info.key}: chunk {read.path} could not be read ({e.strerror})") from None
            if size < info.chunk_nbytes:
                raise StoreUnreadable(f"{info.key}: chunk {read.path} ends {info.chunk_nbytes - size:,} bytes short")
            mm = self._maps[read.path] = np.memmap(read.path, dtype=info.dtype, mode="r", shape=info.chunks)
            while len(self._maps) > _KEPT_MAPS:
                self._maps.popitem(last=False)
        return mm[_slices(read.piece.inner)]

    def _read_raw_gpu(self, dev: Device, out: Any, box: tuple[tuple[int, int], ...]) -> None:
        """The block's pieces by :func:`block_reads`, all at once: KvikIO reads the direct
        ones into place while the host threads copy the staged ones from maps of their
        chunks (only the piece's own columns) through pinned buffers, on this thread's
        stream. No device buffer is made (a block's reads stay inside the budget) and
        nothing waits for the stream: work enqueued on it afterwards sees the block."""
        info = self.info
        reads = block_reads(info, box)
        direct = [r for r in reads if r.how == "direct"]
        staged = [r for r in reads if r.how == "staged"]
        if direct:
            dev.synchronize()  # KvikIO copies on streams of its own: nothing may still use out
        requests = [(r.path, r.offset, out[r.piece.outer[0][0] : r.piece.outer[0][1]]) for r in direct]
        try:
            with io.started(requests) as landing:
                if staged:
                    transfer.load_pieces(
                        dev, [(out[_slices(r.piece.outer)], self._mapped(r)) for r in staged], spread=True
                    )
                seconds = landing.wait()
        except (EOFError, FileNotFoundError) as e:
            raise StoreUnreadable(f"{info.key}: {e}") from None
        if direct:
            dev.count_read("h2d", sum(r.nbytes for r in direct), seconds)
        fills = [r for r in reads if r.how == "fill"]
        if fills:
            with dev.on_stream():
                for r in fills:
                    out[_slices(r.piece.outer)] = info.fill_value


def output_chunks(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """An output's chunks: whole rows, about ``OUTPUT_CHUNK_BYTES`` each."""
    row = math.prod(shape[1:]) * np.dtype(dtype).itemsize
    rows = max(1, min(shape[0], OUTPUT_CHUNK_BYTES // max(1, row)))
    return (rows, *shape[1:])


@dataclass(frozen=True)
class ZarrSink:
    """An output Zarr store written tile by tile under a temporary name, renamed on success.

    Its chunks are stored uncompressed (whole rows, :func:`output_chunks`); ``key`` is the
    job key that names it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    partial: str = ""
    keep: bool = True
    key: str = "params.output"

    @classmethod
    def for_path(
        cls, path: str, shape: tuple[int, ...], dtype: str, *, keep: bool = True, key: str = "params.output"
    ) -> ZarrSink:
        p = Path(path)
        partial = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.partial")
        shape = tuple(int(s) for s in shape)
        return cls(path, shape, dtype, output_chunks(shape, dtype), str(partial), keep, key)

    @property
    def info(self) -> ZarrInfo:
        """The store as a source would see it (its chunks' objects under the temporary name)."""
        return ZarrInfo(self.partial, self.shape, self.dtype, self.chunks, True, 0.0, self.key)

    @property
    def nbytes(self) -> int:
        """The chunks' bytes once written (edge chunks are stored whole)."""
        info = self.info
        return math.prod(info.grid) * info.chunk_nbytes

    def create(self) -> None:
        """Write the metadata and every chunk's object at its full size, blocks reserved
        (a disk that filled mid-job would kill a worker writing through a map: SIGBUS).

        Raises
        ------
        JobFailed
            If the filesystem cannot hold the chunks (it filled since the job was checked).
        """
        zarr = require_zarr(self.key)
        zarr.create_array(
            store=self.partial,
            shape=self.shape,
            chunks=self.chunks,
            dtype=self.dtype,
            compressors=None,
            filters=None,
            fill_value=0,
            zarr_format=3,
        )
        info = self.info
        for coords in itertools.product(*(range(g) for g in info.grid)):
            chunk = info.chunk_path(coords)
            os.makedirs(os.path.dirname(chunk), exist_ok=True)
            with open(chunk, "xb") as f:
                reserve(f, info.chunk_nbytes, key=self.key, path=self.path, total=self.nbytes)

    def write(self, index: tuple[slice, ...], block: Any, dev: Device | None = None) -> None:
        """Write ``block`` (on ``dev``, or a host array) at ``index`` into the chunks it meets.

        Each piece goes into its chunk's object through a map of the piece's chunk rows;
        pieces of one chunk written by several tiles at once are disjoint bytes of it.
        """
        box = tuple(s.indices(n)[:2] for s, n in zip(index, self.shape, strict=False))
        box = box + tuple((0, n) for n in self.shape[len(box) :])
        if any(hi <= lo for lo, hi in box):
            return
        info = self.info
        itemsize = np.dtype(self.dtype).itemsize
        for piece in chunk_pieces(self.chunks, box):
            offset, _ = _rows_range(self.chunks, itemsize, piece.inner)
            rows = piece.inner[0][1] - piece.inner[0][0]
            try:
                mm = np.memmap(
                    info.chunk_path(piece.coords),
                    dtype=self.dtype,
                    mode="r+",
                    offset=offset,
                    shape=(rows, *self.chunks[1:]),
                )
            except FileNotFoundError:
                return  # given up (failed or stopped) while this tile still ran
            dst = mm[(slice(None),) + _slices(piece.inner[1:])]
            src = block[_slices(piece.outer)]
            if dev is None:
                dst[...] = src
            else:
                transfer.store(dev, dst, src)
            del mm, dst

    def allocate(self, rows: tuple[int, int]) -> None:
        """Nothing to do: :meth:`create` reserved every chunk's blocks."""

    def commit(self) -> None:
        """Publish the finished store under its name (an older one given ``--force`` goes),
        or drop it if it was scratch."""
        if not self.keep:
            self.discard()
            return
        publish(self.partial, self.path)

    def discard(self) -> None:
        remove(self.partial)


def output_sink(
    path: str, shape: tuple[int, ...], dtype: str, *, key: str, force: bool, keep: bool = True
) -> NpySink | ZarrSink:
    """The sink of an output named ``path``: an ``.npy`` file or a ``.zarr`` store,
    checked before anything starts (see :func:`mgpu.worker.sources.check_output_path`).

    Raises
    ------
    JobInputError
        If the path ends in neither, its folder is missing, it exists without ``force``,
        or it names a store and zarr is not installed.
    """
    name = str(path).rstrip("/")
    suffix = Path(name).suffix
    if suffix not in (".npy", ".zarr"):
        raise JobInputError(f"{key}: {str(path)!r} must end in .npy (a file) or .zarr (a Zarr store)")
    if suffix == ".zarr":
        require_zarr(key)
        full = check_output_path(name, key=key, suffix=suffix, force=force)
        return ZarrSink.for_path(full, shape, dtype, keep=keep, key=key)
    full = check_output_path(name, key=key, suffix=suffix, force=force)
    return NpySink.for_path(full, shape, dtype, keep=keep, key=key)
