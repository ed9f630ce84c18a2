"""``python -m mgpu`` whose workers hold every tile longer: ``python tests/slow_mgpu.py SECONDS ARGS...``.

For the tests that stop a job mid-way on a cluster mgpu starts itself: the SlowTiles worker
plugin (tests/faults.py) is registered on that cluster as soon as it is open. Nothing else
differs from ``python -m mgpu ARGS...``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from faults import SlowTiles

import mgpu.client.run
from mgpu.cli import cli


def install(seconds: float) -> None:
    """Register SlowTiles(seconds) on every cluster this process's mgpu opens."""
    opened = mgpu.client.run.open_cluster

    @contextlib.contextmanager
    def open_slow(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with opened(*args, **kwargs) as info:
            info.client.register_plugin(SlowTiles(seconds))
            yield info

    mgpu.client.run.open_cluster = open_slow


def prelude(seconds: float) -> str:
    """Python that does :func:`install` in a process started from the repository's root."""
    here = str(Path(__file__).parent)
    return f"import sys; sys.path.insert(0, {here!r}); import slow_mgpu; slow_mgpu.install({seconds!r})"


def main() -> None:
    install(float(sys.argv[1]))
    cli(args=sys.argv[2:], prog_name="mgpu")


if __name__ == "__main__":
    main()
