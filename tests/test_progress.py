"""The tile progress bar: drawn on a terminal (tiles done of total, rate, time left), absent
when output is not a terminal, with ``--json -`` and with ``-q``."""

from __future__ import annotations

import io
import re

import pytest
from conftest import invoke, write_job
from rich.console import Console

import mgpu.cli
from mgpu.cli import _Reporter
from mgpu.tiling import Plan, Tile

BAR = re.compile(r"tiles ━+")  # the bar's line: its label, then the bar (tables use ━ too)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _plain(text: str) -> str:
    """What a person reads: the terminal's colour and cursor codes taken out."""
    return _ANSI.sub("", text)


def _plan(n: int) -> Plan:
    return Plan([Tile(i, {"n": (i, i + 1)}) for i in range(n)], "static", {"n": 1}, 8, 1 << 20)


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=120), out


def test_bar_on_a_terminal_shows_tiles_done_of_total_and_the_rate():
    console, out = _terminal()
    reporter = _Reporter(console, show_progress=True)
    reporter.planned(_plan(4))
    for _ in range(4):
        reporter.tile_done(None)
    reporter.close()
    text = _plain(out.getvalue())
    assert "mgpu: plan: 4 tiles" in text
    assert "4/4" in text and "tiles/s" in text and BAR.search(text)
    reporter.close()  # closing twice is harmless (submit closes after the job, too)


def test_no_bar_when_told_not_to_draw_one():
    console, out = _terminal()
    reporter = _Reporter(console, show_progress=False)
    reporter.planned(_plan(4))
    reporter.tile_done(None)
    reporter.close()
    text = _plain(out.getvalue())
    assert "mgpu: plan: 4 tiles" in text
    assert "1/4" not in text and not BAR.search(text)


@pytest.fixture
def job(tmp_path):
    # Enough tiles for the bar to have something to count.
    return write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 4000}, "tiling": {"n": 500}})


def test_submit_draws_no_bar_when_output_is_not_a_terminal(job, scheduler):
    res = invoke("submit", job, "--scheduler", scheduler)  # CliRunner's output is not a terminal
    assert res.code == 0, res.output
    assert "mgpu: plan: 8 tiles" in res.stdout
    assert not BAR.search(res.output) and "tiles/s" not in res.output and "8/8" not in res.output


@pytest.mark.parametrize("extra,bar", [((), True), (("--json", "-"), False), (("-q",), False)])
def test_submit_on_a_terminal_draws_the_bar_unless_json_to_stdout_or_quiet(job, scheduler, monkeypatch, extra, bar):
    # The CLI's console believes it writes to a terminal, as it would in a shell.
    monkeypatch.setattr(mgpu.cli, "Console", lambda **kw: Console(force_terminal=True, width=120, **kw))
    res = invoke("submit", job, "--scheduler", scheduler, *extra)
    assert res.code == 0, res.output
    text = _plain(res.output)
    assert bool(BAR.search(text) and "8/8" in text and "tiles/s" in text) is bar
    if extra == ("-q",):
        assert res.output == ""
