"""``submit -q`` says nothing while a job runs, so it renders nothing and asks the scheduler
nothing for it (a joined cluster's dashboard link is a round trip), inside the job's wall
time; the dashboard's warning still reaches stderr."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from mgpu.cli import _Reporter


class _Unasked:
    """A cluster (or plan) whose every figure fails the test if asked for."""

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"{name} was asked for")


def test_a_quiet_submit_renders_nothing_and_asks_the_scheduler_nothing():
    info = _Unasked()
    info.__dict__["dashboard_address"] = None  # a joined cluster: no dashboard mgpu started
    reporter = _Reporter(Console(quiet=True), show_progress=False)
    reporter.cluster_ready(info)  # no dashboard_link, no devices
    reporter.planned(_Unasked())  # no describe()


def test_a_quiet_submit_still_warns_of_a_dashboard_open_beyond_this_machine(capsys):
    info = SimpleNamespace(dashboard_address=("0.0.0.0:8787", "http://host:8787/status"))
    _Reporter(Console(quiet=True), show_progress=False).cluster_ready(info)
    assert "the dashboard listens on 0.0.0.0:8787, beyond this machine" in capsys.readouterr().err
