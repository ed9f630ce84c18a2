"""A Ctrl-C or SIGTERM that Python hands to mgpu's handler while a finalizer runs (a Dask
future's ``__del__`` releasing its key, say) still stops the run: raised there, the
exception would be printed and dropped and the job would finish as if never stopped."""

from __future__ import annotations

import os
import signal
import time
import weakref

import pytest

from mgpu.signals import Interrupted, cancel_on_signals


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(10_000):  # Python runs the handler between these steps: inside the finalizer
        pass


class _SignalsInDel:
    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        _signal_self(self.signum)


class _Owner:
    pass


def _wait_to_be_stopped(seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_lands_in_del_still_stops_the_run(sig):
    with pytest.raises(Interrupted) as stopped, cancel_on_signals():
        victim = _SignalsInDel(sig)
        del victim  # its __del__ runs here, and the handler inside it
        _wait_to_be_stopped()
    assert stopped.value.signum == sig
    assert stopped.value.exit_code == 128 + sig


def test_a_signal_that_lands_in_a_weakref_finalize_callback_still_stops_the_run():
    with pytest.raises(Interrupted) as stopped, cancel_on_signals():
        owner = _Owner()
        weakref.finalize(owner, _signal_self, signal.SIGINT)
        del owner
        _wait_to_be_stopped()
    assert stopped.value.signum == signal.SIGINT


def test_a_signal_outside_any_finalizer_stops_the_run_where_it_lands():
    with pytest.raises(Interrupted), cancel_on_signals():
        started = time.monotonic()
        try:
            _signal_self(signal.SIGINT)
        finally:
            assert time.monotonic() - started < 1.0  # at once: raised inside _signal_self's loop
