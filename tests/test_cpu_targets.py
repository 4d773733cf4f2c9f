"""The CPU kernels on CPUs other than this one: what Numba compiles for is the target
(``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``), and the kernels' vector IR and float16
widening must hold on every x86-64 target, not only the AVX-512 one they were tuned on.

A target without F16C (``NUMBA_CPU_NAME=generic``, what portable caches use) once aborted
the process at the first float16 cache: LLVM lowered ``fpext half`` to a call Numba's JIT
cannot resolve. The integer conversion that replaces it there is tested here in process,
for every pattern, and the whole attention (and the softmax's vector maximum, which the
attention's output cannot show: any maximum gives the same weights up to rounding) in a
subprocess per target."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from llvmlite import ir
from numba import njit
from numba.core import cgutils, config, types
from numba.extending import intrinsic

from nbkv.kernels import cpu_math
from nbkv.kernels.cpu_math import half_to_float_ir, hardware_half, target_features

from conftest import cpu_only

pytestmark = cpu_only

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _soft_half(lanes):
    """An intrinsic widening ``lanes`` float16 bit patterns at ``bits[i]`` into
    ``out[i]`` by the integer path of :func:`half_to_float_ir` (``hardware=False``)."""

    @intrinsic
    def widen(typingctx, bits, i, out):
        def codegen(context, builder, signature, args):
            bits_a = context.make_array(signature.args[0])(context, builder, args[0])
            out_a = context.make_array(signature.args[2])(context, builder, args[2])
            src = cgutils.get_item_pointer(context, builder, signature.args[0], bits_a, [args[1]])
            dst = cgutils.get_item_pointer(context, builder, signature.args[2], out_a, [args[1]])
            if lanes == 1:
                builder.store(half_to_float_ir(builder, builder.load(src), hardware=False), dst)
            else:
                i16v = ir.VectorType(ir.IntType(16), lanes)
                f32v = ir.VectorType(ir.FloatType(), lanes)
                x = builder.load(builder.bitcast(src, i16v.as_pointer()), align=2)
                y = half_to_float_ir(builder, x, hardware=False)
                builder.store(y, builder.bitcast(dst, f32v.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.none(bits, i, out), codegen

    return widen


_widen1, _widen16 = _soft_half(1), _soft_half(16)


@njit
def _all_scalar(bits, out):
    for i in range(bits.shape[0]):
        _widen1(bits, i, out)


@njit
def _all_vector(bits, out):
    for i in range(0, bits.shape[0], 16):
        _widen16(bits, i, out)


@pytest.mark.parametrize("widen", [_all_scalar, _all_vector], ids=["scalar", "16 lanes"])
def test_integer_float16_conversion_is_exact_for_every_pattern(widen):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.full(1 << 16, 7.0, np.float32)
    widen(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    # numbers, subnormals, signed zeros, infinities, and NaNs with their payloads (numpy
    # keeps them too): bit for bit
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_target_features_follow_numba_and_decide_the_float16_path(monkeypatch):
    monkeypatch.setattr(config, "CPU_FEATURES", "+sse2,,-avx512f,+f16c")
    assert target_features() == {"+sse2", "-avx512f", "+f16c"}
    assert hardware_half() == (X86 or platform.machine().lower() in ("aarch64", "arm64"))
    monkeypatch.setattr(config, "CPU_FEATURES", "")  # what NUMBA_CPU_NAME=generic sets
    assert target_features() == frozenset()
    if X86:
        assert not hardware_half()
    monkeypatch.setattr(config, "CPU_FEATURES", None)  # Numba's default: the host's
    assert target_features() == set(cpu_math.llvm.get_host_cpu_features().flatten().split(","))


# run in a fresh interpreter under the target; prints the vector registers it saw
_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import nbkv
    from nbkv import reference
    from nbkv.dtypes import resolve_dtype
    from nbkv.kernels import cpu_attention
    from nbkv.kernels.cpu_math import widen16
    from numba import njit

    @njit
    def widen_all(bits, out):
        for i in range(bits.shape[0]):
            out[i] = widen16(bits[i], 0)

    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(1 << 16, np.float32)
    widen_all(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))
    assert np.isnan(got[~ok]).all()

    from nbkv.kernels.cpu_vector import row_max

    @njit
    def maximum(s, r, nb):
        return row_max(s, r, nb)

    rng = np.random.default_rng(0)
    s = (rng.standard_normal((3, 131)) * 4).astype(np.float32)
    for value in (np.nan, np.inf, -np.inf, 0.0, -0.0):  # NaN never taken; a zero's sign free
        s[rng.random(s.shape) < 0.03] = value
    s[0, 50:] = -np.inf
    s[1, 77] = np.float32(1e30)
    s[2] = -np.inf
    for nb in range(132):  # the vectors (4 x the target's lanes) and the tail
        for r in range(3):
            best = -np.inf
            for x in s[r, :nb]:
                best = x if x > best else best
            assert maximum(s, r, nb) == best, (nb, r)

    for dtype in ("float32", "float16", "bfloat16"):
        # 48: the score tile reads whole lines, then passes (16-bit K); 40: no tile; 10
        # queries: a chunk of 40 rows, the prefill's matrix products (six tiles of six,
        # then 4); 5: 20 rows, the tiles; 33: chunks of 128 rows (21 tiles of six, then 2
        # rows) and 4 (the tile)
        for dim, n_q, seq in (
            (128, 1, 300), (64, 10, 77), (64, 5, 77), (48, 1, 90), (40, 3, 50),
            (128, 33, 300),
        ):
            cache = nbkv.LayerKVCache(512, batch=2, num_kv_heads=2, head_dim=dim, dtype=dtype)
            k = rng.standard_normal((2, 2, seq, dim)).astype(resolve_dtype(dtype))
            v = rng.standard_normal((2, 2, seq, dim)).astype(resolve_dtype(dtype))
            cache.append(k, v)
            q = rng.standard_normal((2, 8, n_q, dim)).astype(np.float32)
            K, V = cache.get_kv()
            want = reference.attention(q, np.asarray(K, np.float64), np.asarray(V, np.float64))
            got = nbkv.attention(q, cache)
            err = np.abs(got - want).max()
            assert err < 2e-5, (dtype, dim, n_q, seq, err)
    # a paged prefill: chunks of 64 queries (256 rows: tiles of six and 4 left over) and
    # 9 (36 rows), each head's positions gathered from pages of 5 in steps of 128 (one
    # starting mid-page where the window cuts in), in both pool layouts; then decode
    # steps at group 16 and 14 (16 and 14 rows: the page tiles, and 2 rows left over)
    from nbkv.tutorial.paging import paged_copy

    for layout, dtype, window, new, heads in (
        ("nhd", "float32", 150, 73, 8), ("hnd", "float16", None, 73, 8),
        ("nhd", "bfloat16", None, 1, 32), ("hnd", "float32", 100, 1, 28),
    ):  # fmt: skip
        k, v = (rng.standard_normal((1, 2, 300, 64)).astype(resolve_dtype(dtype)) for _ in "kv")
        paged, step = paged_copy(k, v, 5, layout=layout, new=new)
        q = rng.standard_normal((new, heads, 64)).astype(np.float32)
        want = reference.attention(
            q.transpose(1, 0, 2)[None], k.astype(np.float64), v.astype(np.float64),
            window=window,
        )[0].transpose(1, 0, 2)  # fmt: skip
        got = nbkv.paged_attention(q, paged, 0, step, window=window)
        err = np.abs(got - want).max()
        assert err < 2e-5, (layout, dtype, err)
    # narrower vectors than AVX-512's: the float32 V pass goes in pieces of 8 positions,
    # a pass of a line at a time (accumulate_lines). Against the whole block in one pass
    # of accumulate_rows (the path it replaces): the same multiply-adds in the same order,
    # bit for bit, for blocks across the pieces' edges, rows left over, offset columns and
    # strided rows
    from nbkv.kernels.cpu_simd import LANES, accumulate_rows, tile_lanes

    assert tile_lanes() < LANES and cpu_attention._LINE_PASSES  # both targets take it
    assert cpu_attention._AHEAD_32 == 16  # and prefetch float32 K and V 16 rows ahead
    # and take a prefill chunk's passes as matrix products
    from nbkv.kernels.cpu_prefill import accumulate_outer, applies, scores_outer, transpose_rows

    rows9, k9 = np.zeros((9, 64), np.float32), np.zeros((64, 64), np.float32)
    assert applies(rows9, k9, k9, rows9, 64)

    @njit
    def whole(s, vb, acc, c0, kind=-1):
        for r in range(0, acc.shape[0] - 3, 4):
            accumulate_rows(s, r, vb, vb.shape[0], acc, c0, kind, 0)

    # (positions, query rows, first column, heads in the pool, head_dim, rows ahead): 48
    # is one pass of 16 at a time, 64 four; 3 rows and ahead 0 take the plain path
    for nb, rows, c0, heads, dim, ahead in (
        (1, 4, 0, 1, 64, 64), (63, 5, 1, 1, 64, 64), (64, 8, 0, 2, 64, 16),
        (65, 4, 3, 1, 48, 64), (200, 9, 7, 3, 64, -32), (300, 4, 0, 1, 48, 64),
        (130, 3, 2, 1, 64, 64), (130, 4, 0, 1, 64, 0),
    ):
        pool = rng.standard_normal((nb, heads, dim)).astype(np.float32)
        vb = pool[:, heads - 1]  # rows a head apart when heads > 1 (a paged "nhd" page)
        s = rng.standard_normal((rows, c0 + nb)).astype(np.float32)
        acc0 = rng.standard_normal((rows, dim)).astype(np.float32)
        got, base = acc0.copy(), acc0.copy()
        cpu_attention._accumulate(s, vb, got, c0, -1, ahead)
        whole(s, vb, base, c0)
        full = rows - rows % 4
        assert np.array_equal(got[:full].view(np.uint32), base[:full].view(np.uint32))
        want = acc0.astype(np.float64) + s[:, c0:].astype(np.float64) @ vb.astype(np.float64)
        assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
        assert np.array_equal(pool[:, heads - 1], vb)  # read, never written
        # float16 rows, packed: _accumulate_block sweeps them in pieces (accumulate_pieces)
        half = vb.astype(np.float16).view(np.uint16)
        got16, base16 = acc0.copy(), acc0.copy()
        cpu_attention._accumulate_block(s[:, c0:], half, got16, 0, ahead or 64)
        whole(s[:, c0:], half, base16, 0, 0)
        assert np.array_equal(got16[:full].view(np.uint32), base16[:full].view(np.uint32))
        # every row, those left over (rows % 4) too, against float64
        want16 = acc0.astype(np.float64) + s[:, c0:].astype(np.float64) @ (
            half.view(np.float16).astype(np.float64)
        )
        assert np.abs(got16 - want16).max() < 1e-4 * max(1.0, np.abs(want16).max())
        # the prefill's V pass (six rows at a time): the same sums, in the same order
        wide = acc0.copy()
        accumulate_outer(s, vb, wide, c0, -1)
        assert np.array_equal(wide[:full].view(np.uint32), base[:full].view(np.uint32))
        assert np.abs(wide - want).max() < 1e-4 * max(1.0, np.abs(want).max())
        # and its score pass, over the rows transposed, against float64
        kt = np.zeros((dim, nb + 16), np.float32)
        transpose_rows(vb, -1, kt)
        sc = np.full((rows, c0 + nb + 16), np.nan, np.float32)
        scores_outer(acc0, kt, sc, c0, nb)
        ref = acc0.astype(np.float64) @ vb.T.astype(np.float64)
        assert np.abs(sc[:, c0 : c0 + nb] - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())
        # the paged kernels' runs, inlined (cpu_paged_pages), are those calls bit for bit
        from nbkv.kernels.cpu_paged_pages import run_accumulate, run_scores

        run_acc, sc2 = acc0.copy(), np.full_like(sc, np.nan)
        run_accumulate(s, vb, run_acc, c0, -1, ahead, True)  # tile_ok holds: 48 and 64
        assert np.array_equal(run_acc.view(np.uint32), got.view(np.uint32))
        plain = np.full_like(sc, np.nan)
        run_scores(acc0, vb, sc2, c0, -1, ahead, True)
        cpu_attention._scores(acc0, vb, plain, c0, -1, ahead)
        assert np.array_equal(sc2.view(np.uint32), plain.view(np.uint32))
    asm = "".join(cpu_attention.attend_serial.inspect_asm().values())
    print("registers:", *sorted(r for r in ("xmm", "ymm", "zmm") if r in asm))
    """
)

_AVX2 = "+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,+bmi,+bmi2,+lzcnt,+movbe"
# a host with AVX2, FMA and F16C but no AVX-512 compiles the haswell target's paths for
# itself: the rest of the suite runs them, in process (the subprocess costs 6 minutes of
# compilation on a two-core guest, and CI has 90 in all)
_HOST = target_features()
_HOST_IS_AVX2 = {"+avx2", "+fma", "+f16c", "-avx512f"} <= _HOST


@pytest.mark.skipif(not X86, reason="x86-64 targets: this host is not x86-64")
@pytest.mark.parametrize(
    ("name", "features", "widest"),
    [
        ("generic", None, "xmm"),
        pytest.param(
            "haswell",
            _AVX2,
            "ymm",
            marks=pytest.mark.skipif(
                _HOST_IS_AVX2, reason="this host is an AVX2 target: the suite runs its paths"
            ),
        ),
    ],
    ids=["x86-64 generic (SSE2, no F16C, no FMA)", "haswell (AVX2)"],
)
def test_attention_matches_the_reference_on_other_x86_targets(tmp_path, name, features, widest):
    env = dict(os.environ, NUMBA_CPU_NAME=name, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CPU_FEATURES", None)
    if features:
        env["NUMBA_CPU_FEATURES"] = features
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = run.stdout.split("registers:")[-1].split()
    # the target took: nothing wider than it has was emitted
    assert widest in seen, seen
    wider = {"xmm": {"ymm", "zmm"}, "ymm": {"zmm"}}[widest]
    assert not wider.intersection(seen), seen


def test_float32_k_and_v_are_prefetched_16_rows_on_only_where_the_v_pass_goes_in_line_passes():
    # on this host's own target: AVX-512 keeps _AHEAD (64), narrower vectors 16 rows (K
    # and V); 16-bit and float64 rows keep _AHEAD everywhere
    from nbkv.kernels import cpu_attention as ca

    assert ca._AHEAD_32 == (16 if ca._LINE_PASSES else ca._AHEAD)
    assert ca._rows_ahead(np.zeros((2, 16), np.float32)) == ca._AHEAD_32
    for dtype in (np.uint16, np.float64):
        assert ca._rows_ahead(np.zeros((2, 16), dtype)) == ca._AHEAD
