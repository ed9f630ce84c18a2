"""``mgpu bench alloc``: what one allocate + use + free costs on one GPU, per allocator
and buffer size (:func:`mgpu.memory.bench.run_alloc_bench`, in this process, no cluster).

Without a GPU the record says why it measured nothing; ``--backend cuda`` there is an error.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from ..memory.bench import parse_sizes, print_alloc_bench, run_alloc_bench
from .harness import BenchInputError, Options, skipped

SIZES = {"tiny": "64KiB,1MiB", "small": "1MiB,64MiB", "full": "1MiB,64MiB,1GiB"}


def buffer_sizes(text: str) -> list[int]:
    """A preset's sizes, or the sizes written out (``1MiB,64MiB``), in bytes.

    Raises
    ------
    BenchInputError
        A size that cannot be read, naming ``--sizes``.
    """
    from ..errors import JobInputError

    try:
        return parse_sizes(SIZES.get(text, text))
    except JobInputError as e:
        raise BenchInputError(f"{e}; or a preset: auto, {', '.join(SIZES)}") from None


def run(opts: Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the suite; returns (what was resolved, the record's body)."""
    from ..errors import JobInputError

    def resolved(backend: str) -> dict[str, Any]:
        preset = opts.sizes if opts.sizes != "auto" else ("full" if backend == "cuda" else "tiny")
        return {"backend": backend, "sizes": buffer_sizes(preset), **opts.extra}

    resolved("cuda")  # a wrong --sizes is named before anything else
    if opts.backend == "cpu":
        return resolved("cpu"), {"alloc": skipped("measures GPU allocators; --backend cpu has none")}
    chosen = resolved("cuda")
    try:
        bench = run_alloc_bench(
            device=opts.extra["device"],
            sizes=chosen["sizes"],
            iterations=opts.extra["iterations"],
            repeats=opts.repeats,
        )
    except JobInputError as e:  # raised before anything is allocated
        no_gpu = str(e).startswith("mgpu bench alloc needs a GPU")
        if no_gpu and opts.backend == "auto":
            return resolved("cpu"), {"alloc": skipped(f"needs a GPU: {str(e).split(': ', 1)[1]}")}
        raise BenchInputError(f"--backend: cuda asked for; {e}" if no_gpu else str(e)) from None
    print_alloc_bench(bench, Console(stderr=True))
    return chosen, {"alloc": {"status": "ok", **bench.to_json()}}
