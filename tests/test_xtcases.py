"""cuBLASXt's configurations in the harness: the same work's file reads and write (plain
NumPy, so on CPU), and mgpu set against each configuration."""

from __future__ import annotations

import numpy as np
import pytest

from mgpu.bench import xtcases


@pytest.mark.parametrize("threads", [1, 3])
def test_an_npy_read_into_a_buffer_and_written_back_is_the_same_array(tmp_path, threads, monkeypatch):
    monkeypatch.setattr(xtcases, "_PIECE", 4096)  # several calls per thread's range
    a = np.random.default_rng(0).standard_normal((301, 77)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    out = np.zeros_like(a)
    assert xtcases.read_npy_into(tmp_path / "a.npy", out, threads) > 0
    np.testing.assert_array_equal(out, a)
    xtcases.write_npy(tmp_path / "c.npy", out * 2, threads)
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * 2)


def test_a_file_of_another_shape_or_a_short_one_is_refused(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match=r"holds float32 \(4, 5\) in C order, expected float32 \(5, 4\)"):
        xtcases.read_npy_into(tmp_path / "a.npy", np.zeros((5, 4), np.float32))
    with open(tmp_path / "a.npy", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    with pytest.raises(EOFError, match="ends at byte"):
        xtcases.read_npy_into(tmp_path / "a.npy", np.zeros((4, 5), np.float32), 2)


def test_mgpu_is_set_against_every_configuration():
    figures = [
        {"config": "pinned", "seconds": 1.5},
        {"config": "pinning", "seconds": 2.0},
        {"config": "same-work", "seconds": 8.0},
        {"config": "pinned-block-4096", "seconds": None},  # no figure: nothing to set against
    ]
    runs = [xtcases.set_against(s, figures) for s in (2.0, 1.0, 4.0)]
    assert runs[0] == {
        "pinned": {"seconds": 1.5, "speedup": 0.75},
        "pinning": {"seconds": 2.0, "speedup": 1.0},
        "same-work": {"seconds": 8.0, "speedup": 4.0},
    }
    median = xtcases.median_speedups(runs)
    assert median["pinned"] == {"seconds": 1.5, "speedup": 0.75}  # of 0.75, 1.5 and 0.375
    assert median["same-work"]["speedup"] == 4.0
    assert [c.name for c in xtcases.CASES if c.host_memory == "pinned"][0] == "pinned"


def test_the_outofcore_summary_takes_each_part_of_the_slowest_tiles_timeline():
    from mgpu.bench.outofcore import median_timeline

    def run(*spans):
        return {
            "timeline": [
                {
                    "span_s": s,
                    "first_load_s": s / 10,
                    "products_s": s / 2,
                    "idle_s": 0.0,
                    "write_tail_s": s / 5,
                    "writes_s": 1.0,
                }
                for s in spans
            ]
        }

    got = median_timeline([run(1.0, 2.0), run(3.0), run(0.5, 4.0), {"timeline": []}, {}])
    assert got == {
        "span_s": 3.0,
        "first_load_s": 0.3,
        "products_s": 1.5,
        "idle_s": 0.0,
        "write_tail_s": 0.6,
        "writes_s": 1.0,
    }
    assert median_timeline([{}]) is None
