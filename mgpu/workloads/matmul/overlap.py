"""A per-tile product of random operands on a GPU, its operands made beside its products.

Made whole, a tile's A and B are generated before its one cuBLAS call, and the check's
pass over A after it: nothing else runs meanwhile. At 32768³ in TF32 (0.2 s of
products on an H200) that was ~5% of the tile (0.207 s against 0.197 of products).
Here the tile's rows go in pieces: B is made first, then each piece of A on the thread's
second stream while the piece before multiplies. With a check, one kernel makes a block
and its rows' sums against a vector at once (``random_block_matvec``): B with B·r, each
piece of A with its share of A·(B·r), so neither is read again (B·r read 4 GiB, 1.4 ms
of an H100's 0.19 s TF32 tile). Each piece's share of the check's C·r is made on the
second stream while the next piece multiplies. Only B, the first piece of A and the last
piece's C·r are not hidden; the products stay large (16384 rows or more each: a 32768³
tile goes in two pieces). On one H100, a probe of these kernels at 32768³ in TF32 spent
5.3 ms outside the products with C·r made this way, 6.2 with all of it after them
(medians of 15 tiles each, alternated; the products took as long either way).

A float64 piece multiplies in cubes (``CUBE``): one cuBLAS call per ``CUBE``³ of it, on
views. On one H100, 16384³ pieces of a 32768³ float64 product ran at 53.1-53.5 TFLOP/s,
where the whole product in one call, or rows of it over all of k and n, ran at 50.4-51.5
(TF32 ran 352-365 either way, so its pieces stay whole).

Only products on tensor cores (TF32, float16, float64) are made so. A float32 product
runs on the CUDA cores, which the second stream's kernels use too: on one H100, in the
same suite run, a 32768³ float32 tile's four pieces took 1.382 s of device time where
the whole product from panels (``operands: distributed``) took 1.331, and the tile 3.6% longer than made
whole before; TF32 and float64 tiles ran 2.6% and 0.6% shorter in pieces.
"""

from __future__ import annotations

from typing import Any

from ...tiling import Tile, split
from ...worker.kernels import gemm_into, matvec_f64, random_block, random_block_matvec
from ...worker.sources import RandomSource
from ..checks import freivalds_vector

__all__ = ["applies", "on_tensor_cores", "pieces_of", "product", "run"]

PIECES = 4  # row pieces of a tile's product, at most
# No piece smaller: on one H100, each after 0.3 s of the same products, TF32 products of
# 8192 x 32768 by 32768 ran at 337 TFLOP/s, 16384 x 32768 by 32768 at 376 and 32768³ at
# 344 (the ceiling's 16384³ at 388); float64 at 51.1-52.8 whatever the rows (see CUBE).
MIN_PIECE_ROWS = 16384
CUBE = 16384  # a float64 piece's products: k and n in blocks of about this size


def pieces_of(rows: int) -> list[tuple[int, int]]:
    """The row pieces of a tile of ``rows`` rows (one piece below ``2 * MIN_PIECE_ROWS``)."""
    return split(rows, max(1, min(PIECES, rows // MIN_PIECE_ROWS)))


def product(xp: Any, a: Any, b: Any, c: Any) -> None:
    """``c = a @ b``: in float64, where k and n are ``2 CUBE`` or more, one call per block
    of k and of n (about ``CUBE`` each), the blocks of k adding up in place; else one call."""
    (k, n), cube = b.shape, CUBE
    if a.dtype != "float64" or min(k, n) < 2 * cube:
        xp.matmul(a, b, out=c)
        return
    for j0, j1 in split(n, n // cube):
        for i, (k0, k1) in enumerate(split(k, k // cube)):
            gemm_into(xp, a[:, k0:k1], b[k0:k1, j0:j1], c[:, j0:j1], accumulate=i > 0)


def on_tensor_cores(dtype: str, precision: str) -> bool:
    """Whether a GPU's product of ``dtype`` at ``precision`` runs on tensor cores: all but
    float32 without TF32, which cuBLAS runs on the CUDA cores."""
    return dtype != "float32" or precision == "tf32"


def applies(workload: Any, dev: Any, tile: Tile) -> bool:
    """Whether the tile runs here: on a GPU, a product on tensor cores, random operands, k
    in one block, rows for two pieces."""
    p = workload.params
    src_a, src_b = workload.sources()
    return (
        dev.is_gpu
        and on_tensor_cores(p.dtype, p.precision)
        and isinstance(src_a, RandomSource)
        and isinstance(src_b, RandomSource)
        and tile.args.get("tk", p.k) >= p.k
        and len(pieces_of(tile.size("m"))) > 1
    )


def run(workload: Any, ctx: Any, tile: Tile) -> tuple[Any, Any, Any, Any]:
    """The tile's C, the check vector r, A·(B·r) and C·r (the last three None without a
    check), made as above.

    Events order the two streams: the second stream starts once B·r and the first piece
    of A are made, each product waits for its piece, and each piece's C·r for its product.
    Before this returns, the second stream waits for the products, and the thread's for
    the second: CuPy hands memory freed on the host back to the stream that made it, which
    could otherwise reuse it while a product still reads it. The host does not wait: the
    check's kernels are launched while the last product runs (on one H100, 32768³ TF32
    tiles spent 5.5-5.7 ms outside their products this way, 5.9-6.0 with a wait here; medians
    of 12 tiles each, in one call).
    """
    p = workload.params
    dev = ctx.dev
    xp = dev.xp
    src_a, src_b = workload.sources()
    (r0, r1), (c0, c1) = tile.bounds["m"], tile.bounds["n"]
    main, side = dev.stream, dev.copy_stream
    bounds = pieces_of(r1 - r0)

    def make(src: Any, rows: tuple[int, int], cols: tuple[int, int], v: Any) -> tuple[Any, Any]:
        """The block and, with a check, its rows' products with ``v``, made at once (on
        the current stream)."""
        kw = dict(seed=src.seed, operand=src.operand, rows=rows, cols=cols, total_cols=src.shape[1], dtype=src.dtype)
        if v is None:
            return random_block(xp, **kw), None
        return random_block_matvec(xp, **kw, v=v)

    made: list[Any] = []
    with dev.on_stream():
        r = freivalds_vector(dev, p.seed, p.n, (c0, c1)) if ctx.verify else None
        b, br = make(src_b, (0, p.k), (c0, c1), r)
        abr = xp.empty(r1 - r0, dtype=xp.float64) if r is not None else None

        def make_a(piece: tuple[int, int]) -> Any:  # and its share of A·(B·r)
            a, sums = make(src_a, (r0 + piece[0], r0 + piece[1]), (0, p.k), br)
            if abr is not None:
                abr[piece[0] : piece[1]] = sums
            return a

        c = xp.empty((r1 - r0, c1 - c0), dtype=p.dtype)
        cr = xp.empty(r1 - r0, dtype=xp.float64) if r is not None else None
        made.append(make_a(bounds[0]))
        side.wait_event(main.record())  # B, B·r and the first piece are made
        for i, (p0, p1) in enumerate(bounds):
            following = None
            if i + 1 < len(bounds):
                with side:
                    made.append(make_a(bounds[i + 1]))
                    following = side.record()
            with ctx.timer():
                product(xp, made[i], b, c[p0:p1])
            if cr is not None:
                if following is None:  # the last piece's: nothing left to hide it behind
                    cr[p0:p1] = matvec_f64(xp, c[p0:p1], r)
                else:
                    side.wait_event(main.record())  # the piece's product is done
                    with side:
                        cr[p0:p1] = matvec_f64(xp, c[p0:p1], r)
            if following is not None:
                main.wait_event(following)
        main.wait_event(side.record())  # the C·r made there, before what follows here
        side.wait_event(main.record())  # the pieces freed below: reused there only after the products
    del made
    return c, r, abr, cr
