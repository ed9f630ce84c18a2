"""Out-of-core matmul on each GPU by itself: C's rows stay on the device, A and B stream through.

Each device owns a contiguous range of C's rows and keeps as many of them as its budget
holds (all of them where they fit: then every byte of A, B and C crosses PCIe once). The
product runs in steps ``C[rows] += A[rows, kblock] @ B[kblock, :]``: a loader thread reads
the next step's block of A (a thread beside it its block of B) while the current step's
product runs (two buffers of A, at least two of B), and writer threads write each
finished band of C into the output file while the products of the other bands go on.
The first block is read in
small pieces, so the first product starts after a few milliseconds of reading.

C is finished in bands: over the last few k-blocks of a panel (kept on the device, so they
are read once) the steps go band by band, so the first band is done, and written, while
the later bands still multiply; only the last band's write is not hidden. The bands'
phase is as long as the budget allows (it can hold only so much of B beside C), the first
band whole so its products hide the first reads of the final blocks, and the last one
small so its write is short.
Between panels (where C does not fit) the k-blocks run in the other direction, so the
blocks the last panel ended with are still on the device for the next one. Each tile's
record says where its time went (:mod:`mgpu.workloads.matmul.writers`).

Where all of B fits beside four panels' worth of buffers (``SLOTS``: two panels of A, two
of C) in all but a tenth of the budget, and all of C does not (``Schedule.whole_k``), B
stays on the device whole: the first phase multiplies one or two panels' rows by each
block of B as it is read, enough rows that its products outlast B's read; each later
panel is one product over all of k (``beta = 0``), its A read while the panel before
multiplies and its C written while the next two do: each panel's C goes where the panel
before read its A, each A where the oldest C was (:func:`slot_waits` says what each
waits for); the last panel runs in bands. A product over a block of k reads and
writes its rows of C again: on an H100, 32768³ float32 with all of C kept, in blocks of
1024 rows, ran its products at 49 TFLOP/s, where products over all of k in panels of
2816 rows run at 52 (one 32768³ GEMM: 52-53).

B's rows (``B[kblock, :]``) are contiguous in a C-ordered ``.npy``, so they come through
KvikIO; A's blocks ``A[rows, kblock]`` are a range per row, copied from a memory map through
the pinned stager (:mod:`mgpu.worker.transfer`). The schedule is plain data made on the client
(:func:`steps`, from the :class:`Schedule` each tile carries in ``args``), the same
for every device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import JobInputError
from ...sizes import format_bytes
from ...tiling import Plan, Tile, assign_contiguous, split, split_aligned, split_by_size
from ...worker import transfer
from ...worker.device import Device, DeviceFacts
from ...worker.kernels import matvec_f64
from ...worker.sources import NpySource
from ...worker.stores import ZarrSource
from ...worker.tile import TileContext
from ..checks import freivalds_vector
from .workload import Matmul, _Product, _Streamed, _tf32
from .writers import Writers, timeline

__all__ = [
    "Schedule",
    "Step",
    "StreamedMatmul",
    "budget_host_bytes",
    "choose",
    "host_bytes",
    "plan",
    "run",
    "schedule_of",
    "steps",
    "warm_up",
]

BLOCK_ROWS = 2048  # rows of B a step (columns of A): the product stays efficient, the buffers small
FINAL_BLOCKS = 4  # k-blocks kept on the device at a panel's end, so its bands finish one by one
BANDS = 8  # bands of C finished (and written) one after another at a panel's end
# The smallest band (PANEL_QUANTUM where B stays whole), and the unit of panels' heights.
MIN_BAND_ROWS = 256
# Panels are multiples of this many rows (all but the last's rest): cuBLAS's float32
# kernels run tiles of 128 rows of C, and other rows end in a partial tile. On an H100 at
# 32768³, panels of 2713 rows ran at 50.2-51.8 TFLOP/s, of 2560, 2688 and 2816 at
# 51.2-54.3; bands of 340 and 678 rows at 44.6-47, of 256, 512 and 768 at 51.1-52.7.
# Odd multiples where the split allows: at 49152³ cuBLAS 13.1 ran panels of 6784 and
# 7040 rows at 51.6-51.7, of 6912 and 7168 (multiples of 256) at 49.8-49.9.
PANEL_QUANTUM = 128
# The fewest rows a panel over all of k has: shorter products lose the GEMM's rate.
WHOLE_K_ROWS = 2048
# Bands of the last panel over all of k: its write, the one no product hides, is small.
# The last ones halve down to PANEL_QUANTUM rows: on an H100, bands of 128 rows (32768³
# float32) ran at 52.0-52.6 TFLOP/s, of 256 at 51.7-52.2, and the last write halves.
WHOLE_K_BANDS = 4
# Rows of B a step of the first phase where B stays whole: its products add to the first
# phase's C, reading and writing all of it again each block. On an H100, 5632 rows by
# blocks of 2048 rows of 32768 ran at 50.0-50.9 TFLOP/s, of 4096 at 51.8-52.2, of 8192 at
# 52.4-52.6. Taken where the first phase's products outlast B's read twice over (see
# _whole_k): at 49152³ (16 GiB) the jobs ran 4.622-4.633 s against 4.644-4.646 with
# blocks of 2048; at 32768³ (6 GiB; 29 ms of products to 20 ms of B's read a block) the
# last of the first block's pieces waited for the next block, and the jobs ran
# 1.374-1.387 s against 1.365-1.384.
WHOLE_K_BLOCK_ROWS = 4096
# Rows of k a product over all of k takes at once where k is longer than two of them: its
# A is laid out in the slot as contiguous pieces this wide, each multiplied by its rows of
# B, the later ones adding to C. At the power limit on two H100s, 49152³ float32 panels of
# 7168, 7040, 6784 and 1792 rows ran at 52.80 / 51.97 / 51.71 / 51.44 TFLOP/s, against
# 49.95 / 51.43 / 50.47 / 49.99 over all of k in one call (pieces of 8192, 12288 and 24576
# rows, or of 16384 as strided views of A's rows: 49.4-52.2); at 32768³, 2688 rows in two
# pieces 51.46 against 51.61 in one.
WHOLE_K_PIECE = 16384
# Buffers of a panel's rows each, beside B kept whole: two panels' A and two panels' C.
SLOTS = 4
# Rows of float32 whose products outlast the read of the B they multiply: on an H100, B
# came at 29 GB/s beside A's reads while the products ran at 46-52 TFLOP/s, so rows x 2
# flop per 4 bytes read must pass ~3500 (twice as many for float64). With panels of fewer
# rows, the first phase takes two panels': with one panel of 2816 rows (32768³ float32,
# 6 GiB) the GPU waited 0.074-0.146 s for B, with two 0.034-0.059 s in all; with one
# panel of 7168 rows (49152³, 16 GiB) it did not wait for B, and two took 0.8% longer.
B_HIDDEN_ROWS = 3584
# The budget's share left free where B stays whole. The pool's free room lies between the
# blocks still held (the check's vectors, results not yet gathered), so panels sized to
# fill it all may find no free range that large: on an H100, panels filling all but 2% of
# a 6 GiB pool fell back to managed memory in 4 runs of 6 (1.57-1.61 s against 1.44-1.50).
WHOLE_K_SLACK = 0.1
# The first block of the first panel is read in pieces of this many rows of B, doubling:
# the first product waits for 256 rows of B and 256 columns of A (64 MiB at 32768³
# float32), not a whole block (256 MiB in blocks of 1024 rows, 512 in blocks of 2048).
FIRST_ROWS = 256
WRITERS = 2  # pieces of C written at once: the next one starts while the last one's chunks drain
# Steps whose blocks of a compressed store are named ahead, so their chunks decode on the
# host while the steps before multiply (:mod:`mgpu.worker.decoded` keeps what they need).
LOOKAHEAD = 16
_WARMUP_C_BYTES = 1 << 30


@dataclass(frozen=True)
class Step:
    """One product ``C[rows] (+)= A[rows, k0:k1] @ B[k0:k1, :]`` of a device's schedule.

    ``rows`` are relative to the device's first row. ``b_slot`` is the B buffer the block is
    in; ``load_b`` says whether it must be read first (else it is there from a step
    before). ``first`` starts the rows' sums (beta = 0); ``done`` says the rows are
    finished after this step (their C may be written).
    """

    rows: tuple[int, int]
    block: tuple[int, int]
    b_slot: int
    load_b: bool
    first: bool
    done: bool
    panel: int = 0  # the panel of C the rows are in (B kept whole: 0 is the first phase)
    # B kept whole: the buffers (``SLOTS``) the step's block of A is read into and its
    # panel's C is in (the first phase's C spans slots 0 and 1); -1 elsewhere.
    a_slot: int = -1
    c_slot: int = -1
    a_at: int = 0  # B kept whole: where in its slot the block of A starts (elements)
    c_at: int = 0  # B kept whole: where in its slot the rows of C start (elements)


@dataclass(frozen=True)
class Schedule:
    """How one device runs its rows: the sizes the plan chose (all of it is plain data)."""

    panel_rows: int
    block_rows: int
    final_blocks: int
    bands: int
    b_slots: int
    first_rows: int = 0  # the first panel's first block in pieces from this many rows (0: whole)
    smallest_band: int = 0  # the last band in halves down to this many rows (0: equal bands)
    # B kept whole on the device: the panels after the first phase are one product over all of k.
    whole_k: bool = False
    first_panels: int = 2  # B kept whole: panels of rows in the first phase (1 or 2)
    n: int = 0  # B kept whole: columns of C (a slot holds panel_rows rows of max(n, k))
    k_piece: int = 0  # B kept whole: a product over all of k runs in pieces of k this wide (0: at once)

    def steps(self, rows: int, k: int) -> list[Step]:
        return steps(rows, k, self)

    def pieces(self, block: tuple[int, int], k: int) -> list[tuple[int, int]]:
        """The ranges of k a step's product over ``block`` runs in: near-equal pieces of at
        most ``k_piece`` rows where the block is all of k (see ``WHOLE_K_PIECE``), else the
        block itself."""
        if self.k_piece and block == (0, k):
            return split_by_size(k, self.k_piece)
        return [block]


def steps(rows: int, k: int, s: Schedule) -> list[Step]:
    """The steps of a device that owns ``rows`` rows of C, in the order they run.

    Panels of ``s.panel_rows`` rows, one after another; in each, every k-block once for the
    whole panel, except the last ``s.final_blocks``, which run band by band (see
    :func:`band_bounds`: the last bands small, so the last write is short). The first panel's first block comes in pieces growing
    from ``s.first_rows`` rows (see :func:`first_pieces`): the first product waits for a
    small read only. A block needed again stays in its B buffer where it can: the block
    replaced is the one needed again latest (Belady's rule: the order is known), never
    the one the step before multiplies (its product may still run while the next block
    is read).
    """
    if s.whole_k:
        return _whole_k_steps(rows, k, s)
    blocks = split_by_size(k, s.block_rows)
    order: list[tuple[tuple[int, int], tuple[int, int], bool, bool, int]] = []  # rows, block, first, done, panel
    for p, (p0, p1) in enumerate(panel_bounds(rows, s.panel_rows)):
        seq = blocks if p % 2 == 0 else blocks[::-1]
        final = min(s.final_blocks, len(seq) - 1)
        head = seq[: len(seq) - final]
        if p == 0 and s.first_rows:
            head = first_pieces(head[0], s.first_rows) + head[1:]
        for i, blk in enumerate(head):
            order.append(((p0, p1), blk, i == 0, final == 0 and i == len(head) - 1, p))
        if final:
            for b0, b1 in band_bounds(p1 - p0, s.bands, s.smallest_band):
                for blk in seq[len(seq) - final :]:
                    order.append(((p0 + b0, p0 + b1), blk, False, blk == seq[-1], p))
    resident: dict[int, tuple[int, int]] = {}  # B buffer -> the block in it
    out: list[Step] = []
    for t, (rws, blk, first, done, panel) in enumerate(order):
        slot = next((i for i, held in resident.items() if held == blk), None)
        load = slot is None
        if slot is None:
            busy = out[-1].b_slot if out else None
            free = [i for i in range(s.b_slots) if i not in resident]
            if free:
                slot = free[0]
            else:
                later = [i for i in resident if i != busy] or list(resident)
                slot = max(later, key=lambda i: _next_use(resident[i], order, t))
            resident[slot] = blk
        out.append(Step(rws, blk, slot, load, first, done, panel))
    return out


def _whole_k_steps(rows: int, k: int, s: Schedule) -> list[Step]:
    """:func:`steps` where B stays on the device whole (``s.whole_k``), in ``SLOTS``
    buffers of ``s.panel_rows`` rows each.

    The first phase multiplies ``s.first_panels`` panels' rows (C from the start of slot
    0, into slot 1 for two panels) by each block of B as it is read (the first block in
    pieces), so its products outlast B's read (see ``B_HIDDEN_ROWS``); its last block
    runs a panel at a time, so the first one's write starts while the second multiplies.
    Its blocks of A take slot 3 in turn, as many at once as fit (at least two: a block is
    at most ``2 h`` rows by a quarter of a slot's width), so the loader reads ahead as far
    as that lets it, and slot 2 is free for the next panel's A, read while the first
    phase multiplies.

    Each later panel is one product over all of k (beta = 0), in pieces of k where k is
    long (:meth:`Schedule.pieces`: its A lies in the slot piece after piece). Its C goes
    where the panel before read its A (free once that product has run: no write to wait
    for), and its A into a slot free from the start or else the one whose C is oldest:
    from the fourth panel on, a panel's A waits for the C of the panel three before it to
    be written, so the writes have two panels' products to finish in. The last panel runs
    band by band. B is read once, into one buffer (``b_slot`` 0).
    """
    h, n = s.panel_rows, s.n
    size = h * max(n, k)  # a slot's elements
    blocks = split_by_size(k, s.block_rows)
    head = first_pieces(blocks[0], s.first_rows) + blocks[1:] if s.first_rows else blocks
    first = min(rows, s.first_panels * h)
    block = first * s.block_rows  # the first phase's blocks of A: as many as fit in slot 3, in turn
    buffers = size // block

    def a_at(i: int, row: int, width: int) -> int:
        return i % buffers * block + row * width

    out = [Step((0, first), blk, 0, True, i == 0, False, 0, 3, 0, a_at(i, 0, 0)) for i, blk in enumerate(head[:-1])]
    width = head[-1][1] - head[-1][0]
    for i, (b0, b1) in enumerate(panel_bounds(first, h)):  # the last block, a panel at a time
        at = a_at(len(out), b0, width)
        out.append(Step((b0, b1), head[-1], 0, i == 0, len(head) == 1, True, 0, 3, 0, at, b0 * n))
    oldest_c = list(range(-(-first * n // size)))  # slots holding C not yet taken again, oldest first
    free = [slot for slot in range(SLOTS - 1) if slot not in oldest_c]
    last_a = 3
    for p, (p0, p1) in enumerate(panel_bounds(rows - first, h), start=1):
        p0, p1 = first + p0, first + p1
        bands = band_bounds(p1 - p0, s.bands, s.smallest_band) if p1 == rows else [(0, p1 - p0)]
        c_slot, a_slot = last_a, free.pop(0) if free else oldest_c.pop(0)
        out += [
            Step((p0 + b0, p0 + b1), (0, k), 0, False, True, True, p, a_slot, c_slot, b0 * k, b0 * n)
            for b0, b1 in bands
        ]
        oldest_c.append(c_slot)
        last_a = a_slot
    return out


def a_region(st: Step, size: int) -> tuple[int, int]:
    """Where a step's block of A lies, slot ``i`` being elements ``[i size, (i + 1) size)``
    (slots 0 and 1 are one piece of memory: the first phase's C spans them)."""
    lo = st.a_slot * size + st.a_at
    return lo, lo + (st.rows[1] - st.rows[0]) * (st.block[1] - st.block[0])


def c_region(st: Step, size: int, n: int) -> tuple[int, int]:
    """Where a step's rows of C lie (see :func:`a_region`)."""
    lo = st.c_slot * size + st.c_at
    return lo, lo + (st.rows[1] - st.rows[0]) * n


def slot_waits(steps: list[Step], size: int, n: int) -> tuple[list[tuple[int | None, set[int]]], dict[int, set[int]]]:
    """What must be done before the slots take something new, where B stays whole
    (``size``: a slot's elements; ``n``: C's columns). A piece of C is named by the step
    that finishes it (``done``): its write follows that step's product.

    For each step, before its block of A is read: the last product that read an
    overlapping block of A, and the pieces of C in that part of the slots (written
    first). For each panel, before its first product: the pieces of earlier panels' C
    where its C goes. A product that read a block of A needs no wait before a panel's C
    goes there: the products run in order on one stream. Nothing is waited for twice:
    the loader reads in order, and the task's thread has a step's A before its product;
    nor is what lay wholly under a later block of A or panel of C (that one waited for it).
    """
    held: list[tuple[int, int, str, int]] = []  # (lo, hi, "a", step) or (lo, hi, "c", piece), oldest first
    a_wait: list[tuple[int | None, set[int]]] = []
    c_wait: dict[int, set[int]] = {}
    ran, written = -1, set[int]()  # what the loader has waited for so far

    def under(lo: int, hi: int) -> list[tuple[int, int, str, int]]:
        return [u for u in held if u[0] < hi and lo < u[1]]

    def cover(lo: int, hi: int, *new: tuple[int, int, str, int]) -> None:
        held[:] = [u for u in held if not (lo <= u[0] and u[1] <= hi)] + list(new)

    for t, st in enumerate(steps):
        lo, hi = a_region(st, size)
        there = under(lo, hi)
        need = {who for _, _, kind, who in there if kind == "c"} - written
        reader = max((who for _, _, kind, who in there if kind == "a"), default=-1)
        a_wait.append((reader if reader > max([ran, *need]) else None, need))  # a piece written: its product ran
        ran, written = max([ran, reader, *need]), written | need
        cover(lo, hi, (lo, hi, "a", t))
        if st.panel not in c_wait:
            mine = [(i, *c_region(u, size, n)) for i, u in enumerate(steps) if u.panel == st.panel]
            lo, hi = min(r[1] for r in mine), max(r[2] for r in mine)
            c_wait[st.panel] = {who for _, _, kind, who in under(lo, hi) if kind == "c"} - written
            cover(lo, hi, *((r0, r1, "c", i) for i, r0, r1 in mine if steps[i].done))
    return a_wait, c_wait


def panel_bounds(rows: int, most: int) -> list[tuple[int, int]]:
    """``rows`` in the fewest panels of at most ``most`` rows, each a multiple of
    ``PANEL_QUANTUM`` but the last (:func:`~mgpu.tiling.split_aligned`), and odd multiples
    where a quantum moved between two even ones keeps both within ``most``."""
    sizes = [hi - lo for lo, hi in split_aligned(rows, most, PANEL_QUANTUM)]
    even = [i for i, size in enumerate(sizes) if size % (2 * PANEL_QUANTUM) == 0]
    for i, j in zip(even[::2], even[1::2], strict=False):
        if sizes[i] + PANEL_QUANTUM <= most:
            sizes[i] += PANEL_QUANTUM
            sizes[j] -= PANEL_QUANTUM
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def first_pieces(block: tuple[int, int], first: int) -> list[tuple[int, int]]:
    """``block`` cut into pieces of ``first`` rows, ``first``, ``2 first``, ``4 first``, ...
    (the last one what is left): each piece is read while the one before multiplies."""
    k0, k1 = block
    out, size = [], first
    while k0 < k1:
        out.append((k0, min(k1, k0 + size)))
        k0 = out[-1][1]
        size = first if len(out) == 1 else 2 * size
    return out


def band_bounds(rows: int, bands: int, smallest: int) -> list[tuple[int, int]]:
    """``rows`` cut into ``bands`` near-equal bands, the last of them in halves down to
    ``smallest`` rows (none with ``smallest`` 0): the write of the last one, which no
    product hides, is of a small band. The first band stays whole: its steps read the
    final blocks of B for the first time, and a whole band's products hide those reads.
    Where there are rows enough, every band is a multiple of ``smallest`` but the first
    (it takes the rest): see ``PANEL_QUANTUM``.

    With 32768 rows, 8 bands and 256: seven bands of 4096, and 2048, 1024, 512, 256, 256;
    with 2816 rows, 4 bands and 256: 512, 768, 768, and 512, 256.
    """
    if smallest and rows >= bands * smallest:
        units, rest = divmod(rows, smallest)
        sizes = [(hi - lo) * smallest for lo, hi in split(units, bands)]
        sizes[0] += rest  # the first band stays whole, so the halves are whole smallests
    else:
        sizes = [hi - lo for lo, hi in split(rows, min(bands, rows))]
    if smallest and len(sizes) >= 2:
        sizes = sizes[:-1] + _halves(sizes[-1], smallest)
    out, at = [], 0
    for size in sizes:
        out.append((at, at + size))
        at += size
    return out


def _halves(size: int, smallest: int) -> list[int]:
    """``size`` as about ``size/2, size/4, ...`` down to at least ``smallest``, the rest
    last; each after the first a multiple of ``smallest``."""
    out = []
    while size >= 2 * smallest:
        half = size // 2 // smallest * smallest
        out.append(size - half)
        size = half
    return [*out, size] if size else out


def _next_use(blk: tuple[int, int], order: list[Any], t: int) -> int:
    return next((u for u in range(t, len(order)) if order[u][1] == blk), len(order))


def working_set(s: Schedule, rows: int, n: int, itemsize: int, verify: bool, k: int = 0) -> int:
    """Device bytes a schedule holds: C's panel, two A blocks, the B buffers, the check's
    vectors; where B stays whole (its ``k`` rows), ``SLOTS`` panels of A or C beside it."""
    kb = s.block_rows
    if s.whole_k:
        check = 8 * (2 * rows + n + 2 * k) if verify else 0
        return itemsize * (k * n + SLOTS * s.panel_rows * max(n, k)) + check
    check = 8 * (2 * rows + n + 2 * kb) if verify else 0
    return itemsize * (s.panel_rows * n + 2 * s.panel_rows * kb + s.b_slots * kb * n) + check


def _whole_k(rows: int, n: int, k: int, itemsize: int, budget: int, verify: bool) -> Schedule | None:
    """The schedule that keeps all of B on the device, where it and ``SLOTS`` panels (two
    of C, two of A) fit in all but ``WHOLE_K_SLACK`` of the budget with panels of at least
    ``WHOLE_K_ROWS`` rows (a multiple of ``MIN_BAND_ROWS``) and C needs more than one of
    them; None elsewhere. A panel is at most a quarter of the rows: the first phase, whose
    products run over blocks of k as B comes in, is then at most half of the work."""
    per_row = SLOTS * itemsize * max(n, k)
    room = int(budget * (1 - WHOLE_K_SLACK)) - itemsize * k * n - (8 * (2 * rows + n + 2 * k) if verify else 0)
    h = max(0, room) // per_row // MIN_BAND_ROWS * MIN_BAND_ROWS
    if h < min(WHOLE_K_ROWS, rows) or h >= rows:
        return None
    h = min(h, max(WHOLE_K_ROWS, rows // 4))
    first_panels = 1 if h * 4 >= B_HIDDEN_ROWS * itemsize else 2
    # Wider blocks where the first phase's products outlast B's read twice over: its first
    # block comes in pieces, each twice the one before, read while that one multiplies.
    wide = first_panels * h * 4 >= 2 * B_HIDDEN_ROWS * itemsize
    # At most a quarter of a slot's width: two blocks of two panels' rows fit a slot.
    kb = max(1, min(WHOLE_K_BLOCK_ROWS if wide else BLOCK_ROWS, k, max(n, k) // 4))
    piece = WHOLE_K_PIECE if k > 2 * WHOLE_K_PIECE else 0
    return Schedule(
        h,
        kb,
        0,
        WHOLE_K_BANDS,
        1,
        min(FIRST_ROWS, kb),
        PANEL_QUANTUM,
        whole_k=True,
        first_panels=first_panels,
        n=n,
        k_piece=piece,
    )


def choose(rows: int, n: int, k: int, itemsize: int, budget: int, verify: bool) -> Schedule:
    """The schedule for a device owning ``rows`` rows of C under ``budget`` bytes: C's rows
    all kept if they fit, else the tallest panel that does.

    Where C fits, as many final blocks as the budget holds (up to half of k): each band's
    C is written while the later bands multiply, and the longer that phase, the more of
    the writes it hides. Its length is the rows of B the budget keeps beside C, so blocks
    of half the rows are taken where they keep more (two A buffers of half the size
    leave room for more of B): at 32768³ float32 under 6 GiB, 14 blocks of 1024 rows
    (44% of the products) against 5 of 2048 (31%).

    Where all of B fits beside ``SLOTS`` panels, and all of C does not, B stays on the
    device whole (:func:`_whole_k`): A, B and C still cross PCIe once each, and the
    panels after the first phase multiply over all of k at once, at the GEMM's rate.

    Raises
    ------
    JobInputError
        If not even a panel of one row fits.
    """
    whole = _whole_k(rows, n, k, itemsize, budget, verify)
    if whole is not None:
        return whole
    bands = max(1, min(BANDS, rows // MIN_BAND_ROWS))
    fitting: list[Schedule] = []
    for kb in dict.fromkeys((min(BLOCK_ROWS, k), min(BLOCK_ROWS // 2, k))):
        blocks = math.ceil(k / kb)
        for fb in range(min(blocks - 1, max(FINAL_BLOCKS, blocks // 2)), -1, -1):
            s = Schedule(rows, kb, fb, bands, max(2, fb), min(FIRST_ROWS, kb), MIN_BAND_ROWS)
            if working_set(s, rows, n, itemsize, verify) <= budget:
                fitting.append(s)
                break
    if fitting:  # the longest final phase; of equals, the larger blocks
        return max(fitting, key=lambda s: (min(k - 1, s.final_blocks * s.block_rows), s.block_rows))
    kb = min(BLOCK_ROWS, k)
    final = min(FINAL_BLOCKS, math.ceil(k / kb) - 1)
    # C does not fit: panels as tall as the budget allows, with the final blocks kept.
    slots = max(2, final)
    fixed = itemsize * slots * kb * n + (8 * (2 * rows + n + 2 * kb) if verify else 0)
    per_row = itemsize * (n + 2 * kb)
    h = (budget - fixed) // per_row
    if h < 1:
        raise JobInputError(
            f"cluster.memory_limit: {format_bytes(budget)} per device cannot hold one row of C "
            f"({format_bytes(itemsize * n)}) beside {slots} blocks of B ({format_bytes(itemsize * slots * kb * n)}); "
            "use a larger budget or more devices"
        )
    h = int(min(h, rows))
    # The first block whole: read in pieces, it would be read again whole by the second panel.
    return Schedule(h, kb, final, max(1, min(BANDS, h // MIN_BAND_ROWS)), slots, 0, MIN_BAND_ROWS)


def plan(workload: Any, devices: dict[str, Any], budget: int, tiling: dict[str, int], *, spill: bool) -> Plan:
    """One tile per device: a contiguous range of C's rows, its schedule in ``args``."""
    p = workload.params
    if tiling:
        raise JobInputError(
            "tiling: not used with params.operands: streamed (each device runs its rows of C "
            "in panels the budget sets); remove tiling"
        )
    itemsize = np.dtype(p.dtype).itemsize
    workers = list(devices)
    ranges = [r for r in split(p.m, len(workers)) if r[1] > r[0]]
    owners = assign_contiguous(len(ranges), workers)
    rows = max(hi - lo for lo, hi in ranges)
    s = choose(rows, p.n, p.k, itemsize, budget, workload.verify)
    args = {"schedule": dataclasses.asdict(s), "tk": s.block_rows}
    tiles = [Tile(i, {"m": r, "n": (0, p.n)}, owners[i], args=args) for i, r in enumerate(ranges)]
    return Plan(
        tiles,
        "static",
        {"m": s.panel_rows, "n": p.n, "k": p.k if s.whole_k else s.block_rows},
        working_set(s, rows, p.n, itemsize, workload.verify, p.k),
        budget,
        notes={"operands": "streamed", **dataclasses.asdict(s)},
    )


def schedule_of(tile: Tile) -> Schedule:
    """The schedule a streamed tile carries."""
    return Schedule(**tile.args["schedule"])


def host_bytes(workload: Any, plan: Plan) -> int:
    """Bytes the plan moves over PCIe: A once, C once, B once per panel (less the blocks a
    panel finds still on the device)."""
    p = workload.params
    itemsize = np.dtype(p.dtype).itemsize
    if p.input == "random":
        return itemsize * p.m * p.n if p.output else 0
    total = itemsize * (p.m * p.k + (p.m * p.n if p.output else 0))
    for t in plan.tiles:
        for step in schedule_of(t).steps(t.size("m"), p.k):
            if step.load_b:
                total += itemsize * (step.block[1] - step.block[0]) * p.n
    return total


def budget_host_bytes(workload: Any, plan: Plan) -> int:
    """The fewest bytes over PCIe that any schedule keeping C's rows on the devices could
    move under this budget: A and C once, and B once per panel of C the budgets hold."""
    p = workload.params
    itemsize = np.dtype(p.dtype).itemsize
    if p.input == "random":
        return itemsize * p.m * p.n if p.output else 0
    held = max(1, plan.budget // (itemsize * p.n)) * len({t.worker for t in plan.tiles})
    panels = math.ceil(p.m / held)
    return itemsize * (p.m * p.k + (p.m * p.n if p.output else 0) + panels * p.k * p.n)


class _Flags:
    """One threading.Event per step, waited on by another thread; a failure anywhere ends
    every wait (``failed`` holds it)."""

    def __init__(self, n: int, failed: list[BaseException]) -> None:
        self.events = [threading.Event() for _ in range(n)]
        self.failed = failed

    def set(self, t: int) -> None:
        self.events[t].set()

    def wait(self, t: int) -> None:
        while not self.events[t].wait(0.2):
            if self.failed:
                raise self.failed[0]
        if self.failed:
            raise self.failed[0]


def run(workload: Any, ctx: Any, tile: Tile) -> dict[str, Any]:
    """Run the tile's rows of C by the schedule.

    On a GPU a loader thread reads each step's blocks ahead (into a buffer only once the
    step that used it last has multiplied: an event); the task's thread enqueues the
    products in order. On a CPU the loads and products run one after another. On both,
    ``WRITERS`` writer threads write each finished band of C as soon as its products are
    done (an event on a GPU), while the later bands multiply.
    The products are timed on ``ctx`` (:class:`~mgpu.worker.tile.TileContext`), the bytes the
    helper threads moved are counted for this task, and the tile's timeline
    (:func:`~mgpu.workloads.matmul.writers.timeline`) goes in its record's
    ``extra["timeline"]``. Returns C·r and A·(B·r) (float64, None without a check) for
    Freivalds' check.
    """
    held: list[Any] = []
    try:
        return _run(workload, ctx, tile, held)
    finally:
        # A's map and the maps and chunks the sources kept go on a thread of their own:
        # unmapping their pages is no product's work (see HostStaging.let_go).
        ctx.dev.staging.let_go(held)


def _run(workload: Any, ctx: Any, tile: Tile, held: list[Any]) -> dict[str, Any]:
    """:func:`run`, with the sources and maps it reads through put in ``held``: once this
    returns, ``held`` holds the last references to them."""
    started = time.perf_counter()
    p = workload.params
    s = schedule_of(tile)
    dev = ctx.dev
    xp = dev.xp
    gpu = dev.is_gpu
    r0, r1 = tile.bounds["m"]
    rows, n, kb = r1 - r0, p.n, s.block_rows
    src_a, src_b = workload.sources()
    sink = workload.sinks.get("c")
    # A's rows in one map for the whole task, where its blocks come through a map: the
    # kernel maps 64 KiB around each page a copy faults in, so a block's faults map the
    # next blocks' pages of its rows too. With a map made per block, every row faulted
    # again (on an H200, 32768³ from files in 1024-column blocks took 4.3 s, with one map 2.1).
    a_rows = src_a.view((r0, r1)) if isinstance(src_a, NpySource) and s.block_rows < p.k else None
    held += [src_a, src_b, a_rows]
    plan_steps = s.steps(rows, p.k)
    panel_rows = min(rows, s.panel_rows)
    first_use: dict[Any, int] = {}  # block -> the first step that uses it
    for t, st in enumerate(plan_steps):
        first_use.setdefault(st.block, t)
    dev.synchronize()  # KvikIO fills buffers from streams of its own: nothing may still use them
    slot_size = panel_rows * max(n, p.k)
    with dev.on_stream():
        if s.whole_k:
            # B first: the largest piece, while the pool still has room that size (made
            # after the others, 4 GiB of B did not fit a 6 GiB pool and spilled). Slots 0
            # and 1 in one piece: the first phase's C spans them.
            b_all = xp.empty((p.k, n), dtype=p.dtype)
            pair = xp.empty(2 * slot_size, dtype=p.dtype)
            slots = [pair[:slot_size], pair[slot_size:]] + [xp.empty(slot_size, dtype=p.dtype) for _ in range(2)]
        else:  # one panel of C, two blocks of A, the B buffers
            slots = [xp.empty(panel_rows * n, dtype=p.dtype)] + [
                xp.empty(panel_rows * kb, dtype=p.dtype) for _ in range(2)
            ]
            b_bufs = [xp.empty((kb, n), dtype=p.dtype) for _ in range(s.b_slots)]
        if ctx.verify:
            r = freivalds_vector(dev, p.seed, n, (0, n))
            br = xp.zeros(p.k, dtype=xp.float64)
            abr = xp.zeros(rows, dtype=xp.float64)
            cr = xp.zeros(rows, dtype=xp.float64)
    itemsize = slots[0].itemsize
    panel_rows_of: dict[int, tuple[int, int]] = {}  # panel -> its rows
    for st in plan_steps:
        lo, hi = panel_rows_of.get(st.panel, st.rows)
        panel_rows_of[st.panel] = (min(lo, st.rows[0]), max(hi, st.rows[1]))
    if s.whole_k:
        a_wait, c_wait = slot_waits(plan_steps, slot_size, n)
    else:  # one C buffer: a panel's products wait for every piece of the panel before written
        a_wait, c_wait = [], {st.panel + 1: set() for st in plan_steps}
        for t, st in enumerate(plan_steps):
            if st.done:
                c_wait[st.panel + 1].add(t)

    def b_view(t: int) -> Any:
        k0, k1 = plan_steps[t].block
        return b_all[k0:k1] if s.whole_k else b_bufs[plan_steps[t].b_slot][: k1 - k0]

    def a_pieces(t: int) -> list[tuple[tuple[int, int], Any]]:
        """Step t's block of A as ``(its columns, C-contiguous view)``, one for each piece
        of k its product runs in, one after the other in the block's memory (its A
        buffer's start, or where B stays whole, its place in its slot)."""
        st = plan_steps[t]
        a0, a1 = st.rows
        at, memory = (0, slots[1 + t % 2]) if not s.whole_k else (st.a_at, slots[st.a_slot])
        out = []
        for c0, c1 in s.pieces(st.block, p.k):
            size = (a1 - a0) * (c1 - c0)
            out.append(((c0, c1), memory[at : at + size].reshape(a1 - a0, c1 - c0)))
            at += size
        return out

    def c_view(panel: int, st: Step) -> tuple[int, Any]:
        """The panel's first row and its C (where B stays whole, the first phase's spans slots 0 and 1)."""
        p0, p1 = panel_rows_of[panel]
        memory = pair if s.whole_k and panel == 0 else slots[st.c_slot] if s.whole_k else slots[0]
        return p0, memory[: (p1 - p0) * n].reshape(p1 - p0, n)

    moved = {"h2d": 0, "d2h": 0, "h2d_s": 0.0}
    counting = threading.Lock()
    failed: list[BaseException] = []
    used: list[Any] = [None] * len(plan_steps)  # event after step t's products
    used_set, ready = _Flags(len(plan_steps), failed), _Flags(len(plan_steps), failed)
    b_last: dict[int, int] = {}  # B buffer -> the last step so far that multiplies it
    written_pieces: set[int] = set()  # the steps whose piece of C is written (see slot_waits)
    written = threading.Condition()

    def after(t: int) -> None:
        """Wait until step t's products are done (nothing to wait for on a CPU)."""
        if gpu:
            used_set.wait(t)
            used[t].synchronize()

    def load(t: int) -> None:
        st = plan_steps[t]
        (a0, a1), (k0, k1) = st.rows, st.block
        start = time.perf_counter()
        if s.whole_k:  # the slot's last users: a product reading A, pieces of C to write
            reader, pieces = a_wait[t]
            if reader is not None:
                after(reader)
            wait_written(pieces)
        elif t >= 2:
            after(t - 2)  # this A buffer's last step
        b_read = None
        if st.load_b:
            if st.b_slot in b_last and not s.whole_k:  # a block of B kept whole is read once
                after(b_last[st.b_slot])
            if b_reader is not None:
                b_read = b_reader.submit(read_b, t)
        try:
            if a_rows is not None:
                src_a.info.check()  # as read_into does: the file must still be the one checked
            for (c0, c1), piece in a_pieces(t):
                if a_rows is not None:
                    transfer.load(dev, a_rows[a0:a1, c0:c1], piece, spread=True)
                else:
                    src_a.read_into(dev, piece, (r0 + a0, r0 + a1), (c0, c1))
        finally:  # B's read ends before anything is raised: nothing may fill its buffer later
            if b_read is not None:
                b_read.result()
        moved["h2d"] += (a1 - a0) * (k1 - k0) * itemsize
        if st.load_b:
            if b_read is None:
                read_b(t)
            moved["h2d"] += (k1 - k0) * n * itemsize
        dev.synchronize()  # what came through the stager is in once this thread's stream is done
        moved["h2d_s"] += time.perf_counter() - start
        b_last[st.b_slot] = t

    def read_b(t: int) -> None:
        k0, k1 = plan_steps[t].block
        src_b.read_into(dev, b_view(t), (k0, k1), (0, n))
        dev.synchronize()  # this thread's stream: a block staged through pinned buffers is in

    def ahead(t: int) -> None:
        """Name the blocks of compressed stores that steps t, t+1, ... read (nothing for others)."""
        upcoming = plan_steps[t : t + LOOKAHEAD]
        if isinstance(src_a, ZarrSource):
            src_a.ahead(dev, [((r0 + st.rows[0], r0 + st.rows[1]), st.block) for st in upcoming])
        if isinstance(src_b, ZarrSource):
            src_b.ahead(dev, [(st.block, (0, n)) for st in upcoming if st.load_b])

    def write(rws: tuple[int, int], base: int, c: Any) -> None:  # on the writer threads
        sink.write((slice(r0 + rws[0], r0 + rws[1]), slice(0, n)), c[rws[0] - base : rws[1] - base], dev)
        with counting:
            moved["d2h"] += (rws[1] - rws[0]) * n * itemsize

    def loader() -> None:
        try:
            for t in range(len(plan_steps)):
                ahead(t)
                load(t)
                ready.set(t)
        except BaseException as e:  # raised again by the task's thread
            failed.append(e)

    def write_band(rws: tuple[int, int], base: int, t: int, c: Any) -> None:
        try:
            if gpu:
                used[t].synchronize()  # the band's last product has run
            write(rws, base, c)
        finally:
            with written:
                written_pieces.add(t)
                written.notify_all()

    def wait_written(pieces: set[int]) -> None:
        """Wait until these pieces of C (named by the steps that finish them) are no longer
        needed: written (their products run, where nothing is written); a failure, which
        ends the writes, ends the wait."""
        if writers is None:
            if pieces:
                after(max(pieces))
            return
        with written:
            while not pieces <= written_pieces and not failed:
                written.wait(0.2)
        if failed:
            raise failed[0]

    loading = threading.Thread(target=loader, daemon=True, name="mgpu-stream-loader") if gpu else None
    # A step's block of B is read by KvikIO on a thread of its own while its block of A comes
    # through the stager: on an H100, the first phase's reads of 32768³ float32 ran at
    # 24.5-26 GB/s side by side against 21-23 one after the other, and the GPU waited for
    # them 4-10 ms in all against 18-21.
    b_reader = (
        ThreadPoolExecutor(1, thread_name_prefix="mgpu-stream-b") if gpu and isinstance(src_b, NpySource) else None
    )
    writers = Writers(WRITERS, failed) if sink is not None else None
    if writers is not None:
        # The last panel's pages of the output made ready first: its bands' writes, which
        # no product hides, then take 6-8 ms, where with none made they took 11-16 (32768³
        # and 49152³, one H200). Not all of C's: on one H200 host that took a writer
        # 0.8-1.25 s of a 1.38 s job, the bands' writes beside it running at half speed.
        last = panel_rows_of[max(panel_rows_of)]
        writers.put(lambda: sink.allocate((r0 + last[0], r0 + last[1])))
        writers.start()
    if loading is not None:
        loading.start()
    panel = -1
    first = products_end = 0.0
    products: list[Any] = []
    checks: list[Any] = []  # the check's timing after each product (None without a check)
    waits: list[tuple[float, float]] = []  # the task's thread before each product: for its inputs, for a C written
    try:
        with dev.on_stream():
            for t, st in enumerate(plan_steps):
                waited = time.perf_counter()
                if gpu:
                    ready.wait(t)
                else:
                    ahead(t)
                    load(t)
                inputs_s, waited = time.perf_counter() - waited, time.perf_counter()
                (a0, a1), (k0, k1) = st.rows, st.block
                if st.panel != panel:  # a new panel: the pieces of C where its C goes must be written
                    panel = st.panel
                    if writers is not None:  # else the stream orders them
                        wait_written(c_wait.get(panel, set()))
                    base, c = c_view(panel, st)
                waits.append((inputs_s, time.perf_counter() - waited))
                if t == 0:
                    first = time.perf_counter()
                pieces, b, cv = a_pieces(t), b_view(t), c[a0 - base : a1 - base]
                with ctx.timer() as timing:
                    for i, ((c0, c1), a) in enumerate(pieces):
                        _gemm(xp, a, b[c0 - k0 : c1 - k0], cv, first=st.first and i == 0)
                products.append(timing)
                check = None
                if ctx.verify:  # Freivalds: C r against A (B r), B r made once per block
                    with ctx.check_timer() as check:
                        # B kept whole: the first panel made all of B r, block by block.
                        if first_use[st.block] == t and not (s.whole_k and st.panel > 0):
                            br[k0:k1] = matvec_f64(xp, b, r)
                        for (c0, c1), a in pieces:
                            abr[a0:a1] += matvec_f64(xp, a, br[c0:c1])
                        if st.done:
                            cr[a0:a1] = matvec_f64(xp, cv, r)
                checks.append(check)
                if gpu:
                    used[t] = dev.stream.record()
                    used_set.set(t)
                if st.done and writers is not None:
                    writers.put(functools.partial(write_band, st.rows, base, t, c))
        if gpu and plan_steps:
            used[-1].synchronize()
        products_end = time.perf_counter()
        if writers is not None:
            writers.drain()
            writers.close()
        if loading is not None:
            loading.join()
        if b_reader is not None:
            b_reader.shutdown()
        if failed:
            raise failed[0]
        dev.synchronize()
    except BaseException:
        failed.append(RuntimeError("the task stopped"))  # ends the helpers' waits
        # None may still fill or read the buffers once they are let go.
        if writers is not None:
            writers.close(timeout=60)
        if loading is not None and loading.is_alive():
            loading.join(timeout=60)
        if b_reader is not None:
            b_reader.shutdown(cancel_futures=True)
        raise
    end = writers.last_end if writers is not None and writers.pieces else products_end
    products_s = sum(t.seconds for t in products)
    ctx.record.extra["timeline"] = {
        **timeline(started, first or products_end, products_end, max(end, products_end), products_s, writers),
        **idle_by_cause(_gaps(products, checks), waits),
        "checks_s": sum(c.seconds for c in checks if c is not None),
        **product_rates(plan_steps, [t.seconds for t in products], n, p.k),
    }
    # What the helper threads moved, counted for this task.
    dev.count_read("h2d", moved["h2d"], moved["h2d_s"])
    dev.count_read("d2h", moved["d2h"], writers.busy_s if writers is not None else 0.0)
    return {"cr": cr, "abr": abr} if ctx.verify else {"cr": None, "abr": None}


# The task's thread waited (for a step's inputs, or for C to be written) where it took this long.
WAITED_S = 1e-4


def _gaps(products: list[Any], checks: list[Any]) -> list[float]:
    """The device's time before each product since the one before ended, the check's
    kernels between them taken out (0 before the first)."""
    out = [0.0] if products else []
    for t in range(1, len(products)):
        check = checks[t - 1].seconds if checks[t - 1] is not None else 0.0
        out.append(max(0.0, products[t].since(products[t - 1]) - check))
    return out


def idle_by_cause(gaps: list[float], waits: list[tuple[float, float]]) -> dict[str, float]:
    """The device's idle before each product (``gaps``) summed by what the task's thread
    waited for before it enqueued that product (``waits``: seconds for the step's
    inputs, seconds for a panel's C to be written): ``idle_inputs_s`` and
    ``idle_writes_s``, the longer wait taking the gap. Gaps where it waited for neither
    (the thread itself was late) count in neither."""
    out = {"idle_inputs_s": 0.0, "idle_writes_s": 0.0}
    for gap, (inputs, writes) in zip(gaps, waits, strict=True):
        if max(inputs, writes) >= WAITED_S:
            out["idle_writes_s" if writes > inputs else "idle_inputs_s"] += gap
    return out


def product_rates(steps: list[Step], seconds: list[float], n: int, k: int) -> dict[str, float]:
    """TFLOP/s of the products over a block of k (``blocks_tflops``: adding to sums,
    rereading their C) and over all of k (``whole_k_tflops``), for the kinds the steps have."""
    sums = {"blocks_tflops": [0.0, 0.0], "whole_k_tflops": [0.0, 0.0]}  # flop, seconds
    for st, sec in zip(steps, seconds, strict=True):
        kind = sums["whole_k_tflops" if st.block == (0, k) else "blocks_tflops"]
        kind[0] += 2.0 * (st.rows[1] - st.rows[0]) * n * (st.block[1] - st.block[0])
        kind[1] += sec
    return {kind: flop / sec / 1e12 for kind, (flop, sec) in sums.items() if sec > 0}


def warm_up(workload: Any, dev: Any, tile: Tile) -> None:
    """Run the schedule's products once at each of their shapes (the panel's, the first
    block's pieces', the bands'; C's rows halved until C holds at most
    ``_WARMUP_C_BYTES``), both kinds (starting and adding to sums): cuBLAS picks and loads
    their kernels here, not in the steps."""
    p = workload.params
    s = schedule_of(tile)
    n, itemsize = p.n, np.dtype(p.dtype).itemsize
    shapes: set[tuple[int, int, bool]] = set()
    for st in s.steps(tile.size("m"), p.k):
        m = st.rows[1] - st.rows[0]
        while m > 1 and m * n * itemsize > _WARMUP_C_BYTES:
            m //= 2
        # Both kinds where the schedule adds to sums over blocks or pieces of k; a product
        # over all of k in one call (B kept whole) only starts them.
        pieces = s.pieces(st.block, p.k)
        at_once = s.whole_k and st.block == (0, p.k) and len(pieces) == 1
        for first in (True,) if at_once else (True, False):
            shapes.update((m, c1 - c0, first) for c0, c1 in pieces)
    xp = dev.xp
    rows, width = max(m for m, _, _ in shapes), max(w for _, w, _ in shapes)
    with dev.on_stream():
        a, b, c = xp.ones((rows, width), p.dtype), xp.ones((width, n), p.dtype), xp.empty((rows, n), p.dtype)
        for m, w, first in sorted(shapes):
            a_mw = a.reshape(-1)[: m * w].reshape(m, w)  # C-contiguous, as the steps' blocks
            _gemm(xp, a_mw, b[:w], c[:m], first=first)
    dev.synchronize()


def _gemm(xp: Any, a: Any, b: Any, c: Any, *, first: bool) -> None:
    """``c = a @ b`` (first) or ``c += a @ b``, in place.

    A product that starts its sums goes through ``matmul`` (cuBLAS's GemmEx), which on an
    H100 ran a panel of 2816 x 32768 by 32768 float32 at 54.0-54.6 TFLOP/s where
    ``cupy.cublas.gemm`` (Sgemm) ran it at 52.1-52.7; one that adds to them needs the
    latter's beta.
    """
    if first:
        xp.matmul(a, b, out=c)
    elif xp.__name__ == "cupy":
        from cupy import cublas

        cublas.gemm("N", "N", a, b, out=c, alpha=1.0, beta=1.0)
    else:
        c += a @ b


class StreamedMatmul(Matmul):
    """Each device keeps its rows of C (as many as its budget holds) and streams A and B
    through them by the schedule above."""

    schedule = "streamed"

    def plan(
        self, devices: dict[str, DeviceFacts], budget: int, tiling: dict[str, int], *, spill: bool = False
    ) -> Plan:
        return plan(self, devices, budget, tiling, spill=spill)

    def expected_seconds(self, plan: Plan, rates: dict[str, float], devices: int) -> float | None:
        # A tile is all of its device's rows of C; the plan's tile shape is one panel of them.
        rows = max(t.size("m") for t in plan.tiles)
        return super().expected_seconds(
            dataclasses.replace(plan, tile_shape={**plan.tile_shape, "m": rows}), rates, devices
        )

    def run(self, ctx: TileContext, tile: Tile) -> _Product | _Streamed:
        if "schedule" not in tile.args:  # a warm-up's tile makes its own blocks
            return self._run_blocks(ctx, tile)
        p = self.params
        with _tf32(ctx.dev, p.precision == "tf32"):
            out = run(self, ctx, tile)
        (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
        ctx.record.work = 2.0 * (r1 - r0) * (c1 - c0) * p.k
        return _Streamed(out["cr"], out["abr"])

    def naive_host_bytes(self, plan: Plan) -> int | None:
        return None if self.host_bytes() is None else host_bytes(self, plan)  # what the plan moves

    def budget_host_bytes(self, plan: Plan) -> int | None:
        return None if self.host_bytes() is None else budget_host_bytes(self, plan)

    def warmup(self, dev: Device, tile: Tile) -> None:
        super().warmup(dev, tile)
        if "schedule" in tile.args and dev.is_gpu:
            with _tf32(dev, self.params.precision == "tf32"):
                warm_up(self, dev, tile)
