"""The paged kernels' decode passes over one run of a page's rows (a page, or a piece of
a large one), every head: the scores of :func:`score_page` and the V rows of
:func:`accumulate_page`, on a pool of either layout. Part of :mod:`nbkv.kernels.cpu_paged`,
whose tasks call them run by run.

A run is short (16 positions at block size 16), so what a call costs counts: through
:func:`nbkv.kernels.cpu_attention._scores` and ``_accumulate``, about 130 ns a call each, as
much as 16 positions' arithmetic at group 4 (on the Zen 2 guest, 2026-12-06, with the
rows in L1: scores 27.6 ns a position in runs of 16 against 19.0 in runs of 128; V 21.7
against 13.9). Here the runs go through :func:`run_scores` and :func:`run_accumulate`,
inlined into the page passes with the tiles they call: the same tiles in the same order
as those functions (bit for bit), with one call per page for every head instead of one
per page and head where a KV head's query rows are a multiple of four (a decode step at
group 4 or 8; rows left over, and fewer than four rows, still go through those
functions); and whether the tiles apply (:func:`~nbkv.kernels.cpu_simd.tile_ok`)
is asked once a page, as it holds for every head of a pool or none. K and V of 8 pages
of 16 positions in L2, the page passes without prefetches, per position and head: 58 ns
"nhd" and 49 "hnd" through those calls, 42 and 41 now, 35-36 for the tiles called
directly on "hnd" pages. (The page passes inlined into the task as well: "nhd" 50 ns,
and 2.5 s more to compile.) A fresh compile of a paged kernel takes longer than through
``_scores``: on the Zen 2 guest the first decode call, "nhd" float32, 30.7 s with this
module against 24.8 before it (``_scores`` is compiled for the runs left over as well).
"""

from __future__ import annotations

from numba import njit
from numba.extending import overload

from .. import _config
from .cpu_attention import _BLOCK, _LINE_PASSES, _accumulate, _rows, _scores
from .cpu_math import prefetch, touch_rows
from .cpu_simd import accumulate_rows, score_tile, tile_ok

# run_scores / run_accumulate trust their ``simd`` (tile_ok's answer, which the page
# passes ask once a page): not for other callers
__all__ = ["score_page", "accumulate_page"]


@njit(cache=True, inline="always", fastmath=_config.FASTMATH)
def run_scores(qs, kb, s, c0, kind, ahead, simd):
    """:func:`nbkv.kernels.cpu_attention._scores` of ``kb``'s rows, inlined where it is
    called: where :func:`~nbkv.kernels.cpu_simd.tile_ok` holds (``simd``: the caller's
    answer for ``(qs, kb)``), the query rows four at a time by the 4 x 4 tiles of
    :func:`~nbkv.kernels.cpu_simd.score_tile` (float32 K lines prefetched ``ahead`` rows
    on before each tile; 16-bit K prefetched by the tile), then ``_scores`` for the rows
    and positions left over (fewer than four); otherwise ``_scores``. The same sums as
    ``_scores``, bit for bit."""
    rows, nb = qs.shape[0], kb.shape[0]
    r4, n4 = rows - rows % 4, nb - nb % 4
    if not (simd and r4 > 0 and n4 > 0):
        _scores(qs, kb, s, c0, kind, ahead)
        return
    wide = kb.itemsize != 2
    step = max(1, 64 // kb.itemsize)  # elements per 64-byte line
    for r in range(0, r4, 4):
        for j in range(0, n4, 4):
            if r == 0 and wide and ahead != 0:
                for t in range(j + ahead, j + ahead + 4):
                    for d in range(0, kb.shape[1], step):
                        prefetch(kb, t, d)
            score_tile(qs, r, kb, j, s, c0 + j, kind, 0 if r or wide else ahead)
    if n4 < nb:  # the last positions, every row
        _scores(qs, kb[n4:], s, c0 + n4, kind, ahead)
    if r4 < rows:  # the last rows (their lines were asked for above)
        _scores(qs[r4:], kb[:n4], s[r4:], c0, kind, 0)


@njit(cache=True, inline="always", fastmath=_config.FASTMATH)
def run_accumulate(s, vb, acc, c0, kind, ahead, simd):
    """:func:`nbkv.kernels.cpu_attention._accumulate` of ``vb``'s rows, inlined where it is
    called: where ``tile_ok`` holds (``simd``, for ``(acc, vb)``), the rows four at a
    time by :func:`~nbkv.kernels.cpu_simd.accumulate_rows` (on targets narrower than
    AVX-512, float32 rows from memory in pieces of ``_BLOCK``, each first read in memory
    order: a page's rows are few, and ``_accumulate``'s pieces of 8 with rows prefetched
    ahead were slower here, 0.65x the read against 0.69x, "nhd", on the Zen 3 guest of
    2026-12-07), then ``_accumulate`` for the rows left over; otherwise ``_accumulate``.
    The same sums in the same order, bit for bit."""
    rows, nb = acc.shape[0], vb.shape[0]
    r4 = rows - rows % 4
    if not (simd and r4 > 0 and nb > 0):
        _accumulate(s, vb, acc, c0, kind, ahead)
        return
    if _LINE_PASSES and vb.itemsize == 4 and ahead != 0:
        for c in range(0, nb, _BLOCK):
            piece = vb[c : min(c + _BLOCK, nb)]
            touch_rows(piece)
            for r in range(0, r4, 4):
                accumulate_rows(s, r, piece, piece.shape[0], acc, c0 + c, kind, 0)
    else:
        for r in range(0, r4, 4):
            accumulate_rows(s, r, vb, nb, acc, c0, kind, ahead if r == 0 else 0)
    if r4 < rows:  # the last rows (their lines were asked for above)
        _accumulate(s[r4:], vb, acc[r4:], c0, kind, 0)


@njit(cache=True, fastmath=_config.FASTMATH)
def _scores_heads(qs, kb, s, c0):
    """s[h, r, c0 + j] = qs[h, r] . kb[j, h] for every head h, query row r and position j
    of an "nhd" page ``kb`` [n, heads, head_dim], read in memory order (position, then
    head). As :func:`nbkv.kernels.cpu_attention._scores`, four query rows share each K
    row. Where :func:`nbkv.kernels.cpu_simd.tile_ok` holds, the page goes head by head
    through :func:`run_scores` and its vector-IR tiles instead (through ``_scores``, before
    it: 1.35x faster than this loop at block size 16, though each head's rows lie a
    position apart)."""
    heads, rows, dim = qs.shape
    for j in range(kb.shape[0]):
        for h in range(heads):
            kr, qh, sh = kb[j, h], qs[h], s[h]
            r = 0
            while r + 4 <= rows:
                q0, q1, q2, q3 = qh[r], qh[r + 1], qh[r + 2], qh[r + 3]
                k0 = kr[0]
                a0, a1, a2, a3 = q0[0] * k0, q1[0] * k0, q2[0] * k0, q3[0] * k0
                for d in range(1, dim):
                    kd = kr[d]
                    a0 += q0[d] * kd
                    a1 += q1[d] * kd
                    a2 += q2[d] * kd
                    a3 += q3[d] * kd
                sh[r, c0 + j], sh[r + 1, c0 + j] = a0, a1
                sh[r + 2, c0 + j], sh[r + 3, c0 + j] = a2, a3
                r += 4
            while r < rows:
                qr = qh[r]
                a0 = qr[0] * kr[0]
                for d in range(1, dim):
                    a0 += qr[d] * kr[d]
                sh[r, c0 + j] = a0
                r += 1


@njit(cache=True, fastmath=_config.FASTMATH)
def _accumulate_heads(s, vb, acc, c0):
    """acc[h, r] += sum over j of s[h, r, c0 + j] * vb[j, h] for an "nhd" page ``vb``, in
    memory order as :func:`_scores_heads` (and, as it, replaced head by head by
    :func:`run_accumulate` where ``tile_ok`` holds); four positions per pass, so
    each accumulator row loaded takes four multiply-adds."""
    heads, rows, dim = acc.shape
    nb = vb.shape[0]
    j = 0
    while j < nb:
        m = min(4, nb - j)
        for h in range(heads):
            sh, ah = s[h], acc[h]
            if m == 4:
                v0, v1, v2, v3 = vb[j, h], vb[j + 1, h], vb[j + 2, h], vb[j + 3, h]
                for r in range(rows):
                    a, w = ah[r], sh[r]
                    w0, w1, w2, w3 = w[c0 + j], w[c0 + j + 1], w[c0 + j + 2], w[c0 + j + 3]
                    for d in range(dim):
                        a[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
            else:  # the positions left over
                for t in range(j, j + m):
                    v0 = vb[t, h]
                    for r in range(rows):
                        a, w0 = ah[r], sh[r, c0 + t]
                        for d in range(dim):
                            a[d] += w0 * v0[d]
        j += m


def score_page(qs, pool, page, off, n, kind, table, buf, s, c0, ahead):
    """Scores of ``page``'s rows ``off .. off + n - 1``, every head, into columns ``c0 ..``
    of ``s`` [heads, rows, chunk]. By the overload, on the pool's form: "hnd" flattened to
    ``[num_blocks * heads, block_size, head_dim]`` (one head's rows are contiguous: head
    by head) or "nhd" ``[num_blocks, block_size, heads, head_dim]`` (position by
    position). 16-bit rows are widened as they are loaded (``kind``, from ``table``),
    except on ``_scores_heads``'s path, which widens them into ``buf`` [chunk, heads,
    head_dim] first. ``ahead``: as row ``j`` is scored, row ``j + ahead`` of a head's
    rows is prefetched (0: none); :func:`nbkv.kernels.cpu_paged._segment` finds it."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


def accumulate_page(s, pool, page, off, n, kind, table, buf, acc, c0, ahead):
    """The weighted V rows of a page added to ``acc`` [heads, rows, head_dim], as
    :func:`score_page` reads K. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(score_page, jit_options={"cache": True})
def _score_page_impl(qs, pool, page, off, n, kind, table, buf, s, c0, ahead):
    if pool.ndim == 3:

        def hnd(qs, pool, page, off, n, kind, table, buf, s, c0, ahead):
            heads = qs.shape[0]
            simd = tile_ok(qs[0], pool[page * heads, off : off + n])  # as for every head
            for h in range(heads):
                kb = pool[page * heads + h, off : off + n]
                run_scores(qs[h], kb, s[h], c0, kind, ahead, simd)

        return hnd

    def nhd(qs, pool, page, off, n, kind, table, buf, s, c0, ahead):
        kb = pool[page, off : off + n]
        if tile_ok(qs[0], kb[:, 0]):  # head by head, by the vector-IR tiles (cpu_simd)
            for h in range(qs.shape[0]):
                run_scores(qs[h], kb[:, h], s[h], c0, kind, ahead, True)
        else:
            _scores_heads(qs, _rows(kb, table, buf), s, c0)

    return nhd


@overload(accumulate_page, jit_options={"cache": True})
def _accumulate_page_impl(s, pool, page, off, n, kind, table, buf, acc, c0, ahead):
    if pool.ndim == 3:

        def hnd(s, pool, page, off, n, kind, table, buf, acc, c0, ahead):
            heads = acc.shape[0]
            simd = tile_ok(acc[0], pool[page * heads, off : off + n])
            for h in range(heads):
                vb = pool[page * heads + h, off : off + n]
                run_accumulate(s[h], vb, acc[h], c0, kind, ahead, simd)

        return hnd

    def nhd(s, pool, page, off, n, kind, table, buf, acc, c0, ahead):
        vb = pool[page, off : off + n]
        if tile_ok(acc[0], vb[:, 0]):
            for h in range(acc.shape[0]):
                run_accumulate(s[h], vb[:, h], acc[h], c0, kind, ahead, True)
        else:
            _accumulate_heads(s, _rows(vb, table, buf), acc, c0)

    return nhd
