"""``python -m mgpu`` whose workers hold every tile longer: ``python tests/slow_mgpu.py SECONDS ARGS...``.

For the tests that stop a job mid-way on a cluster mgpu starts itself: the SlowTiles worker
plugin (tests/faults.py) is registered on that cluster as soon as it is open. Nothing else
differs from ``python -m mgpu ARGS...``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from faults import SlowTiles

import mgpu.client.run
from mgpu.cli import cli


def main() -> None:
    seconds = float(sys.argv[1])
    opened = mgpu.client.run.open_cluster

    @contextlib.contextmanager
    def open_slow(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with opened(*args, **kwargs) as info:
            info.client.register_plugin(SlowTiles(seconds))
            yield info

    mgpu.client.run.open_cluster = open_slow
    cli(args=sys.argv[2:], prog_name="mgpu")


if __name__ == "__main__":
    main()
