"""The streamed out-of-core matmul: its schedule as data, and jobs from files on CPU workers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import npy_operands, submit_json, write_job
from faults import spoiled

from mgpu.errors import JobInputError
from mgpu.workloads.matmul import stream as ms


def _cover(rows: int, k: int, s: ms.Schedule) -> None:
    """Every (row, k) pair multiplied exactly once; sums started before they are added to
    and finished once; a block read only into a buffer the step before does not use."""
    done = np.zeros((rows, k), np.int32)
    started = np.zeros(rows, bool)
    finished = np.zeros(rows, np.int32)
    resident: dict[int, tuple[int, int]] = {}
    b_read = np.zeros(k, np.int32)  # B kept whole: each of its rows read once, before use
    steps = s.steps(rows, k)
    for t, st in enumerate(steps):
        (a0, a1), (k0, k1) = st.rows, st.block
        done[a0:a1, k0:k1] += 1
        if s.whole_k:
            b_read[k0:k1] += st.load_b
            assert (b_read[k0:k1] == 1).all() and (st.panel == 0 or not st.load_b)
            assert st.panel == 0 or (st.block == (0, k) and st.first and st.done)  # one product over all of k
        if st.first:
            assert not started[a0:a1].any() or finished[a0:a1].all()  # a new panel
            started[a0:a1] = True
            finished[a0:a1] = 0
        assert started[a0:a1].all() and not finished[a0:a1].any()
        if st.done:
            finished[a0:a1] += 1
        if st.load_b and not s.whole_k:
            assert t == 0 or st.b_slot != steps[t - 1].b_slot
            resident[st.b_slot] = st.block
        assert s.whole_k or resident[st.b_slot] == st.block  # the block is in the buffer the step reads
        assert 0 <= st.b_slot < s.b_slots
    assert (done == 1).all() and (finished == 1).all()
    assert not s.whole_k or (b_read == 1).all()
    if s.whole_k:
        _slots_safe(steps, s, k)


def _slots_safe(steps: list[ms.Step], s: ms.Schedule, k: int) -> None:
    """Where B stays whole: nothing goes into the slots while what it covers may still be needed.

    The loader reads the steps' blocks of A in order, each after its wait
    (:func:`ms.slot_waits`): a step's product (and every one before it, one stream), and
    pieces of C written (their products run). So what is surely done before a step's A
    is read is what its wait and the reads before it waited for. A block of A goes into
    the slots only once every earlier product that read an overlapping block has run,
    and every piece of C there (of a panel begun before the step) is written; a panel's
    C goes in only once every piece of earlier panels' C there is written."""
    size = s.panel_rows * max(s.n, k)
    a_wait, c_wait = ms.slot_waits(steps, size, s.n)
    panel_first: dict[int, int] = {}
    for t, st in enumerate(steps):
        panel_first.setdefault(st.panel, t)
    pieces = [(u, ms.c_region(st, size, s.n)) for u, st in enumerate(steps) if st.done]

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    ran: list[int] = []  # per step: the last product surely run before its A is read
    written: list[set[int]] = []  # per step: the pieces of C surely written by then
    for t, st in enumerate(steps):
        done, out = (ran[-1], set(written[-1])) if t else (-1, set())
        reader, need = a_wait[t]
        out |= need
        done = max([done, *need] + ([reader] if reader is not None else []))
        assert done < t
        if done >= 0:
            out |= written[done]  # a product ran after its own A was read
        ran.append(done)
        written.append(out)
        lo, hi = ms.a_region(st, size)
        assert st.a_slot * size <= lo < hi <= (st.a_slot + 1) * size  # within its slot
        for u in range(t):
            if overlap(ms.a_region(steps[u], size), (lo, hi)):
                assert done >= u, (t, u)
        for u, region in pieces:
            if panel_first[steps[u].panel] < t and overlap(region, (lo, hi)):
                assert u in out, (t, u)
        assert not overlap(ms.c_region(st, size, s.n), (lo, hi))  # A and C of one step apart
    # The task's thread has each step's A (what the loader waited for) before its product,
    # and waits for each panel's pieces in turn.
    task_written: set[int] = set()
    for p, t0 in sorted(panel_first.items()):
        task_written |= written[t0]
        for u in c_wait[p]:
            assert u < t0
            task_written |= {u} | written[u]
        mine = [ms.c_region(st, size, s.n) for st in steps if st.panel == p]
        for u, region in pieces:
            if steps[u].panel < p and any(overlap(region, m) for m in mine):
                assert u in task_written, (p, u)


def test_the_slots_wait_for_what_lies_under_each_block_of_a_and_panel_of_c():
    # Slots of 100 elements, C 10 wide; A and C placed by hand where a schedule might.
    def step(t: int, a_slot: int, a_at: int, c_slot: int, c_at: int) -> ms.Step:
        rows = (0, 10) if t == 0 else (5 + 5 * t, 10 + 5 * t)
        return ms.Step(rows, (0, 4), 0, False, True, True, t, a_slot, c_slot, a_at, c_at)

    steps = [
        step(0, 1, 0, 0, 0),  # A [100, 140), C [0, 100)
        step(1, 0, 60, 1, 0),  # A over the first C: its write first; C over the first A: no wait
        step(2, 0, 0, 1, 20),  # A over the first C again: waited for already; C over part of the second C
        step(3, 1, 0, 2, 0),  # A over the part of the second C that the third left
    ]
    a_wait, c_wait = ms.slot_waits(steps, 100, 10)
    assert a_wait == [(None, set()), (None, {0}), (None, set()), (None, {1})]
    assert c_wait == {0: set(), 1: set(), 2: {1}, 3: set()}
    _slots_safe(steps, ms.Schedule(10, 4, 0, 1, 1, whole_k=True, n=10), 4)


@pytest.mark.parametrize(
    "rows,k,panel,kb,final,bands",
    [
        (100, 64, 100, 16, 2, 4),
        (100, 64, 30, 16, 2, 4),
        (97, 61, 40, 8, 3, 8),
        (10, 5, 3, 5, 2, 2),
        (50, 64, 50, 64, 4, 8),
    ],
)
@pytest.mark.parametrize("first,smallest", [(0, 0), (4, 3), (1, 1)])
def test_every_product_runs_once_and_every_row_is_finished_once(rows, k, panel, kb, final, bands, first, smallest):
    _cover(rows, k, ms.Schedule(panel, kb, final, bands, max(2, final), first, smallest))
    # B kept whole: the first panel over its blocks as they come, the others over all of k.
    # Its blocks at most a quarter of k wide, as _whole_k makes them: two of two panels' rows fit a slot.
    for panels in (1, 2):  # the first phase over one panel's rows or two
        whole = ms.Schedule(
            panel, max(1, min(kb, k // 4)), 0, bands, 1, first, smallest, whole_k=True, first_panels=panels, n=k
        )
        _cover(rows, k, whole)


def test_b_stays_whole_where_it_fits_beside_four_panels_and_all_of_c_does_not():
    s = ms.choose(rows=32768, n=32768, k=32768, itemsize=4, budget=6 << 30, verify=True)
    assert s.whole_k and s.panel_rows % ms.MIN_BAND_ROWS == 0 and ms.WHOLE_K_ROWS <= s.panel_rows < 32768
    # The panels are as tall as fit in all but the slack the pool's free ranges need.
    room = (6 << 30) * (1 - ms.WHOLE_K_SLACK)
    assert ms.working_set(s, 32768, 32768, 4, True, 32768) <= room
    taller = dataclasses.replace(s, panel_rows=s.panel_rows + ms.MIN_BAND_ROWS)
    assert ms.working_set(taller, 32768, 32768, 4, True, 32768) > room
    steps = s.steps(32768, 32768)
    widths = [st.block[1] - st.block[0] for st in steps[:5]]
    assert widths == [256, 256, 512, 1024, 2048]  # the first block in pieces, each read while the last multiplies
    # B read once, in the first phase, whose products cover two panels' rows (they outlast
    # B's read); its last block a panel at a time, the second panel's part read with the first's.
    pieces = len(ms.first_pieces((0, s.block_rows), s.first_rows))
    assert sum(st.load_b for st in steps) == 32768 // s.block_rows - 1 + pieces
    assert all(st.panel == 0 for st in steps if st.load_b)
    first = [st for st in steps if st.panel == 0]
    assert first[0].rows == (0, 2 * s.panel_rows) and [st.rows for st in first[-2:]] == [
        (0, s.panel_rows),
        (s.panel_rows, 2 * s.panel_rows),
    ]
    # The next panel's A is read as soon as the first phase's reads are done: it waits for
    # no product (the first phase's blocks of A take another slot, eight at once there),
    # nor do those reads wait for more than the product eight steps before.
    size = s.panel_rows * 32768
    a_wait, c_wait = ms.slot_waits(steps, size, 32768)
    assert a_wait[len(first)] == (None, set()) and {st.a_slot for st in first} == {3}
    at_once = size // (2 * s.panel_rows * s.block_rows)
    assert at_once == 8 and [a_wait[t][0] for t in range(len(first))] == [None] * 8 + list(range(len(first) - 8))
    # No panel's products wait for a write; a panel's A waits for the first phase's first
    # piece (the second panel), its second (the third), or the C of the panel three before.
    assert not any(c_wait.values())
    first_of = {st.panel: t for t, st in reversed(list(enumerate(steps)))}
    done_of = {st.panel: t for t, st in enumerate(steps) if st.done}
    pieces = [t for t, st in enumerate(steps) if st.done and st.panel == 0]
    assert a_wait[first_of[2]][1] == {pieces[0]} and a_wait[first_of[3]][1] == {pieces[1]}
    assert all(a_wait[first_of[p]][1] == {done_of[p - 3]} for p in range(4, max(first_of) + 1))
    _slots_safe(steps, s, 32768)
    # No product ends in part of a kernel's tile: every one's rows a multiple of 128.
    assert {(st.rows[1] - st.rows[0]) % ms.PANEL_QUANTUM for st in steps} == {0}
    # Three quarters of the work and more in products over all of k; the last write small.
    whole = sum((st.rows[1] - st.rows[0]) * 32768 for st in steps if st.block == (0, 32768))
    assert whole / 32768**2 > 0.75
    done = [st.rows[1] - st.rows[0] for st in steps if st.done]
    assert sum(done) == 32768 and done[-1] <= 512
    # Panels tall enough to outlast B's read alone: the first phase is one panel's rows.
    big = ms.choose(rows=49152, n=49152, k=49152, itemsize=4, budget=16 << 30, verify=True)
    assert big.whole_k and big.panel_rows >= ms.B_HIDDEN_ROWS and big.first_panels == 1
    # Its products outlast B's read twice over: wider blocks of k, which add to C less often.
    assert s.block_rows == ms.BLOCK_ROWS and big.block_rows == ms.WHOLE_K_BLOCK_ROWS > ms.BLOCK_ROWS
    assert big.steps(49152, 49152)[0].rows == (0, big.panel_rows)
    # Its later products over all of k in three pieces of k; the first phase's blocks and
    # all of 32768³'s products in one call each.
    assert big.pieces((0, 49152), 49152) == [(0, 16384), (16384, 32768), (32768, 49152)]
    assert big.pieces((0, big.block_rows), 49152) == [(0, big.block_rows)]
    assert {len(s.pieces(st.block, 32768)) for st in steps} == {1}
    _slots_safe(big.steps(49152, 49152), big, 49152)
    # Its panels odd multiples of 128 rows (no two even ones could become odd within the slot).
    big_steps = big.steps(49152, 49152)
    panels = [st.rows[1] - st.rows[0] for st in big_steps if 0 < st.panel < big_steps[-1].panel]
    assert panels and {h // ms.PANEL_QUANTUM % 2 for h in panels} == {1} and max(panels) <= big.panel_rows
    # Every block of A the first phase reads fits beside the others (each of the first
    # block's pieces takes a block's room): its reads wait only for the pieces' products.
    big_wait, _ = ms.slot_waits(big_steps, big.panel_rows * 49152, 49152)
    pieces = len(ms.first_pieces((0, big.block_rows), big.first_rows))
    assert [w for w, st in zip(big_wait, big_steps, strict=True) if st.panel <= 1 and w != (None, set())] == [
        (t, set()) for t in range(pieces - 1)
    ]
    # C narrower or wider than A: the first phase's C spans part of slot 1, or all of it.
    for n, k in [(1000, 3000), (3000, 1000), (2000, 3000)]:
        odd = ms.choose(rows=9000, n=n, k=k, itemsize=4, budget=160_000_000, verify=True)
        assert odd.whole_k and odd.first_panels == 2
        _cover(9000, k, odd)
    # Where B cannot stay whole beside four panels of WHOLE_K_ROWS rows: C is kept, or panels of it.
    assert not ms.choose(rows=32768, n=32768, k=32768, itemsize=4, budget=5 << 30, verify=True).whole_k
    # Where all of C fits beside B, C is kept: the products' sums stay on the device.
    assert not ms.choose(rows=4096, n=4096, k=32768, itemsize=4, budget=16 << 30, verify=True).whole_k


def test_the_first_product_waits_for_a_small_read_and_the_last_write_is_small(monkeypatch):
    monkeypatch.setattr(ms, "WHOLE_K_ROWS", 1 << 20)  # C kept, as where B cannot stay whole
    s = ms.choose(rows=32768, n=32768, k=32768, itemsize=4, budget=6 << 30, verify=True)
    # Blocks of 1024 rows leave room for more of B beside C than blocks of 2048 (5 of them).
    assert s.block_rows == 1024 and s.final_blocks * s.block_rows > 5 * 2048
    steps = s.steps(32768, 32768)
    widths = [st.block[1] - st.block[0] for st in steps[:4]]
    assert widths == [256, 256, 512, 1024]  # the first block in pieces, each read while the last multiplies
    assert [st.load_b for st in steps[:4]] == [True] * 4
    done = [st.rows[1] - st.rows[0] for st in steps if st.done]
    # The first band reads the final blocks of B: its products are a whole band's, to hide those reads.
    assert sum(done) == 32768 and done[0] == 32768 // ms.BANDS and done[-1] == ms.MIN_BAND_ROWS
    assert done[-2] == ms.MIN_BAND_ROWS and max(done) == 32768 // ms.BANDS
    # The bands' products, which hide the writes of all bands but the last, are 40% of all.
    banded = sum((st.rows[1] - st.rows[0]) * (st.block[1] - st.block[0]) for st in steps if st.rows != (0, 32768))
    assert banded / 32768**2 == s.final_blocks * s.block_rows / 32768 > 0.4


def test_bands_are_whole_smallests_but_one_and_the_last_ones_halve_down_to_it():
    sizes = lambda rows, bands: [hi - lo for lo, hi in ms.band_bounds(rows, bands, 256)]  # noqa: E731
    assert sizes(2816, 4) == [512, 768, 768, 512, 256]
    assert sizes(2688, 4) == [640, 768, 512, 512, 256]  # the rest (128) in the first band
    assert sizes(32768, 8) == [4096] * 7 + [2048, 1024, 512, 256, 256]
    assert sizes(700, 4) == [175, 175, 175, 175]  # too few rows for whole ones: near-equal


def test_blocks_stay_for_the_next_panel_and_bands_finish_one_by_one():
    s = ms.Schedule(panel_rows=40, block_rows=10, final_blocks=3, bands=4, b_slots=3)
    steps = s.steps(120, 100)  # 3 panels of 40 rows, 10 blocks of B
    loads = sum(st.load_b for st in steps)
    # Each panel after the first finds the 3 blocks it starts with (the last one's final blocks).
    assert loads == 10 + 7 + 7
    # The first panel's bands finish in order, each after its own final blocks only.
    done = [st.rows for st in steps[:19] if st.done]
    assert done == [(0, 10), (10, 20), (20, 30), (30, 40)]


def test_the_schedule_keeps_all_of_c_where_it_fits_and_panels_where_not(monkeypatch):
    monkeypatch.setattr(ms, "WHOLE_K_ROWS", 1 << 20)  # C kept, as where B cannot stay whole
    s = ms.choose(rows=1000, n=800, k=600, itemsize=4, budget=64 << 20, verify=True)
    assert s.panel_rows == 1000 and s.final_blocks == min(ms.FINAL_BLOCKS, 0) or s.block_rows == 600
    big = ms.choose(rows=32768, n=32768, k=32768, itemsize=4, budget=6 << 30, verify=True)
    assert big.panel_rows == 32768  # C (4 GiB) and the buffers fit
    assert ms.working_set(big, 32768, 32768, 4, True) <= 6 << 30
    # The bands' phase is as long as the budget allows: one more final block would not fit.
    more = ms.Schedule(32768, big.block_rows, big.final_blocks + 1, big.bands, big.final_blocks + 1)
    assert big.final_blocks >= ms.FINAL_BLOCKS and ms.working_set(more, 32768, 32768, 4, True) > 6 << 30
    # Up to half of k, where the budget holds more.
    roomy = ms.choose(rows=4096, n=4096, k=32768, itemsize=4, budget=16 << 30, verify=True)
    assert roomy.block_rows == ms.BLOCK_ROWS and roomy.final_blocks == 32768 // ms.BLOCK_ROWS // 2
    tight = ms.choose(rows=32768, n=32768, k=32768, itemsize=4, budget=3 << 30, verify=True)
    assert tight.panel_rows < 32768 and ms.working_set(tight, 32768, 32768, 4, True) <= 3 << 30
    with pytest.raises(JobInputError, match="cluster.memory_limit: .* cannot hold one row of C"):
        ms.choose(rows=100, n=1 << 20, k=1 << 20, itemsize=4, budget=1 << 20, verify=True)


def _files(tmp_path, m, k, n):
    return npy_operands(tmp_path, m, k, n, seed=9)


# All of C on each worker; panels of it; B whole, the later panels' products over all of k
# in one call or in four pieces of k.
@pytest.mark.parametrize("limit,piece", [("8MB", 0), ("200KB", 0), ("420KB", 0), ("420KB", 40)])
def test_streamed_matmul_from_files_to_a_file(tmp_path, scheduler, monkeypatch, limit, piece):
    monkeypatch.setattr(ms, "BLOCK_ROWS", 32)  # 5 blocks of B (the plan is made here, on the client)
    monkeypatch.setattr(ms, "MIN_BAND_ROWS", 8)
    monkeypatch.setattr(ms, "WHOLE_K_ROWS", 16)
    if piece:
        monkeypatch.setattr(ms, "WHOLE_K_PIECE", piece)
    m, k, n = 203, 150, 170
    if piece:
        s = ms.choose(rows=102, n=n, k=k, itemsize=8, budget=420_000, verify=True)
        assert s.whole_k and [b - a for a, b in s.pieces((0, k), k)] == [37, 38, 37, 38]
    a, b, files = _files(tmp_path, m, k, n)
    out = tmp_path / "c.npy"
    doc = {
        "workload": "matmul",
        "params": {"input": files, "output": str(out), "operands": "streamed"},
        "cluster": {"memory_limit": limit},
    }
    res, data = submit_json(write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json", "--scheduler", scheduler)
    assert res.code == 0, res.output + res.stderr
    assert data["verify"]["passed"] is True and data["plan"]["tiles"] == 2  # a range of rows per worker
    np.testing.assert_allclose(np.load(out), a @ b, rtol=1e-10, atol=1e-10)
    pcie = data["pcie"]
    assert pcie["minimum_bytes"] == 8 * (m * k + k * n + m * n)
    # What the workers moved is what the plan said; within one panel a worker reads B once.
    assert pcie["bytes"] == pcie["naive_bytes"] >= pcie["budget_minimum_bytes"] >= pcie["minimum_bytes"]
    # Products over all of k where B stays whole beside panels of C, over its blocks elsewhere.
    assert (data["plan"]["tile_shape"]["k"] == k) is (limit == "420KB")
    if limit == "8MB":
        assert pcie["bytes"] == 8 * (m * k + 2 * k * n + m * n)  # B once per worker
        assert data["plan"]["tile_shape"]["m"] == 102  # each worker all its rows of C
    elif limit == "420KB":  # B once per worker, kept whole beside panels of C
        assert pcie["bytes"] == 8 * (m * k + 2 * k * n + m * n)
        assert 16 <= data["plan"]["tile_shape"]["m"] < 102
    else:  # panels of C: B again for each, less the 4 blocks each finds still there
        panels = -(-102 // data["plan"]["tile_shape"]["m"])
        assert panels >= 2
        b_reads = (pcie["bytes"] - 8 * (m * k + m * n)) / (8 * k * n) / 2  # B's per worker
        assert 1 < b_reads < panels


def test_several_writers_write_every_band_and_the_timeline_adds_up(tmp_path, scheduler, monkeypatch):
    monkeypatch.setattr(ms, "BLOCK_ROWS", 32)  # the plan is made here, on the client
    monkeypatch.setattr(ms, "MIN_BAND_ROWS", 4)
    m, k, n = 203, 150, 170
    a, b, files = _files(tmp_path, m, k, n)
    out = tmp_path / "c.npy"
    doc = {
        "workload": "matmul",
        "params": {"input": files, "output": str(out), "operands": "streamed"},
        "cluster": {"memory_limit": "8MB"},
    }
    res, data = submit_json(write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json", "--scheduler", scheduler)
    assert res.code == 0, res.output + res.stderr
    np.testing.assert_allclose(np.load(out), a @ b, rtol=1e-10, atol=1e-10)
    assert data["verify"]["passed"] is True
    assert data["pcie"]["bytes"] == 8 * (m * k + 2 * k * n + m * n)  # C written once, B once per worker
    rows = 102  # each of the two workers' rows of C, in bands
    schedule = ms.choose(rows, n, k, 8, 8_000_000, True)
    bands = ms.band_bounds(rows, schedule.bands, schedule.smallest_band)
    assert len(bands) > ms.WRITERS
    spans = {d["id"]: d["span_s"] for d in data["per_device"]}
    assert [t["tile"] for t in data["timeline"]] == [0, 1]
    for t in data["timeline"]:
        parts = [t["first_load_s"], t["products_s"], t["idle_s"], t["write_tail_s"]]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(t["span_s"], abs=1e-6)
        assert t["span_s"] <= spans[t["device"]] + 1e-6  # within the tile's own span
        assert t["products_s"] > 0 and t["writes_s"] > 0
        assert t["pieces"] == len(bands) + 1  # every band, and the last panel's pages made first
        # The idle's causes are parts of it (each gap counted once, the check's kernels apart).
        causes = t["idle_inputs_s"] + t["idle_writes_s"] + t["checks_s"]
        assert min(t["idle_inputs_s"], t["idle_writes_s"], t["checks_s"]) >= 0
        assert causes <= t["idle_s"] + 1e-4
        assert t["blocks_tflops"] > 0 and t["whole_k_tflops"] is None  # every product over a block of k


def test_the_idle_before_a_product_goes_to_what_the_task_waited_for():
    gaps = [0.0, 0.5, 0.25, 0.125, 2.0]
    waits = [(1.0, 0.0), (0.3, 0.0), (0.01, 0.2), (0.0, 0.0), (ms.WAITED_S / 2, 0.0)]
    # The first product's wait is the first load (not idle); a gap with no wait is the thread's own.
    assert ms.idle_by_cause(gaps, waits) == {"idle_inputs_s": 0.5, "idle_writes_s": 0.25}


def test_the_gaps_between_products_leave_out_the_checks_between_them():
    from mgpu.worker.device import Timing

    products = [Timing(1.0, 0.0, 1.0), Timing(1.0, 1.5, 2.5), Timing(0.5, 2.5, 3.0)]
    checks = [Timing(0.25, 1.0, 1.25), None, None]
    assert ms._gaps(products, checks) == [0.0, 0.25, 0.0]
    assert products[1].since(products[0]) == 0.5  # on a CPU: the wall clock between them


def test_the_product_rates_are_kept_apart_by_whether_they_run_over_all_of_k():
    k, n = 64, 10
    steps = [
        ms.Step((0, 8), (0, 32), 0, True, True, False),
        ms.Step((0, 8), (32, 64), 0, True, False, True),
        ms.Step((8, 16), (0, 64), 0, False, True, True),
    ]
    rates = ms.product_rates(steps, [1e-9, 3e-9, 2e-9], n, k)
    assert rates == pytest.approx(
        {"blocks_tflops": 2 * 8 * 10 * 64 / 4e-9 / 1e12, "whole_k_tflops": 2 * 8 * 10 * 64 / 2e-9 / 1e12}
    )


def test_a_job_whose_writes_fail_mid_way_leaves_no_output(tmp_path, cluster, scheduler):
    from distributed import Client
    from faults import FailWrites

    a, b, files = _files(tmp_path, 64, 40, 30)
    out = tmp_path / "c-fails.npy"
    doc = {
        "workload": "matmul",
        "params": {"input": files, "output": str(out), "operands": "streamed"},
    }
    with Client(scheduler) as client:
        client.register_plugin(FailWrites("c-fails.npy"))
        try:
            res, data = submit_json(
                write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json", "--scheduler", scheduler
            )
        finally:
            client.unregister_worker_plugin(FailWrites.name)
    assert res.code != 0 and "no space left (a test's stand-in)" in res.output
    assert not out.exists() and not list(tmp_path.glob(".c-fails.npy.*"))  # nothing under its name, no partial


def test_a_corrupted_streamed_product_fails_its_check(tmp_path, monkeypatch):
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.tile import run_tile
    from mgpu.workloads.matmul import Matmul, MatmulParams

    monkeypatch.setattr(ms, "BLOCK_ROWS", 16)
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    _, _, files = _files(tmp_path, 60, 50, 40)
    job = Matmul(MatmulParams(input=files, operands="streamed"))
    plan = job.plan({"w": dev.facts}, 1 << 20, {})
    (tile,) = plan.tiles
    assert plan.notes["operands"] == "streamed" and tile.args["schedule"]["block_rows"] == 16
    assert run_tile(job, dev, tile).verify_ok is True
    bad = run_tile(spoiled(job), dev, tile)
    assert bad.verify_ok is False and bad.verify_error > 1e-6


def test_streamed_with_tiling_is_refused(tmp_path, scheduler):
    doc = {"workload": "matmul", "params": {"m": 8, "n": 8, "k": 8, "operands": "streamed"}, "tiling": {"m": 4}}
    res, data = submit_json(write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json", "--scheduler", scheduler)
    assert res.code == 2 and "tiling: not used with params.operands: streamed" in res.stderr
    assert data is None


def test_streamed_random_inputs_match_numpy(tmp_path, scheduler):
    from mgpu.worker import kernels

    m, k, n = 90, 70, 50
    out = tmp_path / "c.npy"
    doc = {
        "workload": "matmul",
        "params": {"m": m, "n": n, "k": k, "dtype": "float64", "output": str(out), "operands": "streamed"},
    }
    res, data = submit_json(write_job(tmp_path / "job.yaml", doc), tmp_path / "r.json", "--scheduler", scheduler)
    assert res.code == 0, res.output + res.stderr
    a = kernels.random_block(np, seed=0, operand=0, rows=(0, m), cols=(0, k), total_cols=k, dtype="float64")
    b = kernels.random_block(np, seed=0, operand=1, rows=(0, k), cols=(0, n), total_cols=n, dtype="float64")
    np.testing.assert_allclose(np.load(out), a @ b, rtol=1e-12, atol=1e-12)
    assert data["verify"]["passed"] is True


def test_a_float64_product_goes_in_cubes_that_add_up_to_the_whole(monkeypatch):
    from mgpu.workloads.matmul import overlap

    monkeypatch.setattr(overlap, "CUBE", 16)
    calls = []

    def gemm_into(xp, a, b, c, *, accumulate):
        calls.append((a.shape, b.shape, accumulate))
        c[...] = a @ b + (c if accumulate else 0)

    monkeypatch.setattr(overlap, "gemm_into", gemm_into)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((40, 70)), rng.standard_normal((70, 50))
    c = np.full((40, 50), np.nan)  # a first block of k that added to it would leave NaN
    overlap.product(np, a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-12)
    assert len(calls) == 3 * 4 and [acc for _, _, acc in calls] == [False, True, True, True] * 3
    assert sum(bs[1] for _, bs, acc in calls if not acc) == 50 and sum(bs[0] for _, bs, _ in calls[:4]) == 70
    calls.clear()  # float32, or k or n under two cubes: one call of its own
    overlap.product(np, a.astype(np.float32), b.astype(np.float32), c.astype(np.float32))
    overlap.product(np, a[:, :20], b[:20], c)
    assert calls == []
    np.testing.assert_allclose(c, a[:, :20] @ b[:20], rtol=1e-12)


def test_a_random_tile_runs_in_row_pieces_on_a_gpu_only():
    from mgpu.tiling import Tile
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.workloads.matmul import Matmul, MatmulParams, overlap

    assert overlap.pieces_of(4 * overlap.MIN_PIECE_ROWS) == [
        (i * overlap.MIN_PIECE_ROWS, (i + 1) * overlap.MIN_PIECE_ROWS) for i in range(4)
    ]
    assert overlap.pieces_of(2 * overlap.MIN_PIECE_ROWS - 1) == [(0, 2 * overlap.MIN_PIECE_ROWS - 1)]
    assert len(overlap.pieces_of(100 * overlap.MIN_PIECE_ROWS)) == overlap.PIECES
    job = Matmul(MatmulParams(m=32768, n=64, k=64, precision="tf32"))
    tile = Tile(0, {"m": (0, 32768), "n": (0, 64)}, args={"tk": 64})
    cpu = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    gpu = Device("cuda", None, DeviceFacts("cuda", 0, "gpu", 1 << 30, 1 << 30, "h"))
    assert not overlap.applies(job, cpu, tile) and overlap.applies(job, gpu, tile)
    split_k = Tile(0, {"m": (0, 32768), "n": (0, 64)}, args={"tk": 32})
    assert not overlap.applies(job, gpu, split_k)  # k in blocks: the tile reads them one by one


@pytest.mark.parametrize(
    "dtype,precision,pieces",
    [
        ("float32", "default", False),
        ("float32", "tf32", True),
        ("float16", "default", True),
        ("float64", "default", True),
    ],
)
def test_only_a_product_on_tensor_cores_runs_in_row_pieces(dtype, precision, pieces):
    # A float32 product runs on the CUDA cores, which the pieces' second stream shares:
    # its tile multiplies whole.
    from mgpu.tiling import Tile
    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.workloads.matmul import Matmul, MatmulParams, overlap

    job = Matmul(MatmulParams(m=32768, n=64, k=64, dtype=dtype, precision=precision))
    tile = Tile(0, {"m": (0, 32768), "n": (0, 64)}, args={"tk": 64})
    gpu = Device("cuda", None, DeviceFacts("cuda", 0, "gpu", 1 << 30, 1 << 30, "h"))
    assert overlap.on_tensor_cores(dtype, precision) is pieces
    assert overlap.applies(job, gpu, tile) is pieces


def test_a_tile_leaves_its_maps_to_the_releasing_thread_alone(tmp_path, monkeypatch):
    import gc

    from mgpu.worker.device import Device, DeviceFacts
    from mgpu.worker.sources import NpySource
    from mgpu.worker.tile import run_tile
    from mgpu.workloads.matmul import Matmul, MatmulParams

    monkeypatch.setattr(ms, "BLOCK_ROWS", 16)  # A read through a map of its rows
    dev = Device("cpu", np, DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h"))
    handed: list[list] = []
    monkeypatch.setattr(dev.staging, "let_go", handed.append)
    a, b, files = _files(tmp_path, 60, 50, 40)
    job = Matmul(MatmulParams(input=files, operands="streamed"))
    (tile,) = job.plan({"w": dev.facts}, 1 << 20, {}).tiles
    assert run_tile(job, dev, tile).verify_ok is True
    (held,) = handed
    src_a, src_b, a_rows = held
    assert isinstance(src_a, NpySource) and isinstance(src_b, NpySource)
    assert isinstance(a_rows, np.memmap) and a_rows.filename == files["a"]
    gc.collect()
    for obj in held:  # whoever lets go of the last other reference pays for the unmapping
        assert [r for r in gc.get_referrers(obj) if r is not held] == []


def test_the_releasing_thread_lets_go_of_what_it_is_given():
    import threading

    from mgpu.worker.transfer import HostStaging

    let_go = threading.Event()
    where: list[str] = []

    class Held:
        def __del__(self) -> None:
            where.append(threading.current_thread().name)
            let_go.set()

    staging = HostStaging()
    held = [Held()]
    staging.let_go(held)
    assert let_go.wait(10)
    staging.close()
    assert held == [] and len(where) == 1 and where[0].startswith("mgpu-release")


def _rss_kib(address: int) -> int:
    """Resident KiB of the mapping that holds ``address`` in this process."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise LookupError(hex(address))


def test_a_map_let_go_drops_its_pages_in_pieces_and_keeps_the_file(tmp_path, monkeypatch):
    from mgpu.worker import transfer

    monkeypatch.setattr(transfer, "DROP_PIECE", 1 << 20)
    data = np.arange(2 << 20, dtype=np.float32)  # 8 MiB
    np.save(tmp_path / "a.npy", data)
    mm = np.load(tmp_path / "a.npy", mmap_mode="r")
    assert float(mm.sum()) == float(data.sum())  # every page touched
    address = mm.ctypes.data
    assert _rss_kib(address) >= 8 << 10
    transfer.drop_pages(mm)
    assert _rss_kib(address) == 0  # unmapping it now frees no page
    np.testing.assert_array_equal(mm, data)  # the file's bytes are where they were
    shared = np.load(tmp_path / "a.npy", mmap_mode="r+")
    shared[:4] = -2
    transfer.drop_pages(shared)  # written pages: still in the file once dropped
    assert _rss_kib(shared.ctypes.data) == 0
    del shared
    assert list(np.load(tmp_path / "a.npy")[:4]) == [-2, -2, -2, -2]
    private = np.load(tmp_path / "a.npy", mmap_mode="c")
    private[:4] = -1
    transfer.drop_pages(private)  # a private map's changes are its own: left alone
    assert list(private[:4]) == [-1, -1, -1, -1]


def _kernel_at_least(major: int, minor: int) -> bool:
    import platform
    import re

    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found[1]), int(found[2])) >= (major, minor)


@pytest.mark.skipif(not _kernel_at_least(5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_band_of_a_writable_map_is_mapped_before_its_copy_and_nothing_else_is(tmp_path):
    from mgpu.worker import transfer

    out = np.lib.format.open_memmap(tmp_path / "c.npy", mode="w+", dtype=np.float32, shape=(64, 16384))
    del out
    shared = np.load(tmp_path / "c.npy", mmap_mode="r+")  # 4 MiB, no page touched yet
    assert _rss_kib(shared.ctypes.data) == 0
    transfer.map_for_writing(shared[:, :1024])  # a column block: a sixteenth of what it spans
    assert _rss_kib(shared.ctypes.data) == 0
    transfer.map_for_writing(shared[16:32])  # rows 16-31: 1 MiB, across 257 pages (the header shifts it)
    assert 1 << 10 <= _rss_kib(shared.ctypes.data) <= (1 << 10) + 8
    shared[16:32] = 3  # the copy into it lands in the file as before
    del shared
    assert float(np.load(tmp_path / "c.npy")[16:32].sum()) == 3 * 16 * 16384
    read_only = np.load(tmp_path / "c.npy", mmap_mode="r")
    transfer.map_for_writing(read_only[:16])  # not opened for writing: left alone
    transfer.map_for_writing(np.zeros((4, 4), np.float32))  # not a map
    assert _rss_kib(read_only.ctypes.data) == 0


def test_the_estimate_counts_all_of_a_devices_rows_not_one_panel(tmp_path):
    from mgpu.worker.device import DeviceFacts
    from mgpu.workloads.matmul import Matmul, MatmulParams

    facts = DeviceFacts("cpu", 0, "cpu", 1 << 30, 1 << 30, "h")
    job = Matmul(MatmulParams(input=_files(tmp_path, 96, 64, 80)[2], operands="streamed"))
    whole, panels = job.plan({"w": facts}, 1 << 20, {}), job.plan({"w": facts}, 120_000, {})
    assert whole.tile_shape["m"] == 96 > panels.tile_shape["m"]
    rates = {job.ceiling(): 1e-6}  # only the product: 1 TFLOP/s is 1e-6 in its units
    assert job.expected_seconds(panels, rates, 1) == job.expected_seconds(whole, rates, 1) == 2 * 96 * 80 * 64 / 1e6
