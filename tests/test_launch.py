"""The CUDA launch geometry (nbkv.launch) and the tunables: pure functions, any machine."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import nbkv
from nbkv.launch import (
    AttentionGrid,
    append_config,
    attention_grid,
    attention_scratch_shapes,
    launch_config,
    resident_blocks,
    wave_splits,
)


def test_launch_config_fills_warps_and_caps_the_grid():
    assert launch_config(1) == (1, 32)
    assert launch_config(1024) == (4, 256)
    assert launch_config(0) == (1, 32)
    blocks, threads = launch_config(64 * 8 * 4096 * 128)
    assert (blocks, threads) == (65_535, 256)  # capped: each thread loops


@pytest.mark.parametrize(
    "args, want",
    [
        ((1, 32, 8, 1, 512), (4, 8, 1)),  # 4 tiles of 128: no more splits than tiles
        ((1, 32, 8, 1, 32768), (66, 8, 1)),  # 528 blocks: 4 per SM of 132
        ((8, 32, 8, 1, 32768), (8, 64, 1)),  # 512 of 528 slots, not 576 (a second wave)
        ((16, 32, 8, 1, 32768), (4, 128, 1)),  # 512, not 640 for 528 slots
        ((64, 32, 8, 1, 4096), (1, 512, 1)),
        ((1, 32, 8, 5, 4096), (32, 8, 2)),  # 4 x 5 query rows: two chunks of 16, 32 tiles
    ],
)
def test_the_grids_an_h200_gets(args, want):
    grid = attention_grid(*args, sm_count=132, tile=128)
    assert tuple(grid) == want and grid.blocks == math.prod(want)


@given(
    batch=st.integers(1, 64),
    kv_heads=st.integers(1, 8),
    group=st.integers(1, 8),
    n_q=st.integers(1, 40),
    span=st.integers(1, 100_000),
    sms=st.integers(1, 200),
    tile=st.sampled_from([32, 64, 128]),
    forced=st.one_of(st.none(), st.integers(1, 500)),
)
def test_any_grid_covers_the_work_without_empty_splits(
    batch, kv_heads, group, n_q, span, sms, tile, forced
):
    g = attention_grid(
        batch, kv_heads * group, kv_heads, n_q, span, sm_count=sms, tile=tile, splits=forced
    )
    assert g.tasks == batch * kv_heads
    assert g.chunks == math.ceil(group * n_q / nbkv.tunables()["ATTENTION_ROWS"])
    assert 1 <= g.splits <= span  # a split of no position would divide by nothing
    if forced is None:
        assert g.splits <= math.ceil(span / tile)
        # one wave: never more blocks than resident slots, unless one split each is more
        assert g.blocks <= max(4 * sms, g.tasks * g.chunks)
    else:
        assert g.splits == min(forced, span)


@pytest.mark.parametrize(
    "threads, registers, shared, want",
    [
        (128, 111, 39_012, 4),  # the main decode kernel: registers allow 4, shared 5
        (128, 64, 39_012, 5),  # then shared memory is the limit
        (128, 32, 1_000, 16),  # then threads (2048 per SM)
        (32, 16, 100, 32),  # then the 32-block cap
        (1024, 255, 48_000, 1),  # at least 1
    ],
)
def test_resident_blocks_take_the_tightest_limit(threads, registers, shared, want):
    assert resident_blocks(threads, registers=registers, shared=shared) == want


def test_wave_splits_fill_one_wave_and_follow_a_forced_count():
    assert wave_splits(528, 8, 32768, 128) == 66
    assert wave_splits(528, 128, 32768, 128) == 4
    assert wave_splits(528, 1000, 32768, 128) == 1  # more work than slots: one split each
    assert wave_splits(528, 8, 300, 128) == 3  # no more splits than tiles
    assert wave_splits(528, 8, 300, 128, forced=7) == 7
    assert wave_splits(528, 8, 5, 128, forced=7) == 5  # never a split of no position


def test_append_config_covers_a_row_with_power_of_two_lanes():
    assert append_config(8, 128, 8) == (1, (16, 16))
    assert append_config(8 * 8192, 128, 8) == (4096, (16, 16))
    assert append_config(3, 3, 1) == (1, (4, 64))
    blocks, (lanes, rows) = append_config(10**9, 256, 1)
    assert blocks == nbkv.tunables()["MAX_BLOCKS"] and lanes * rows == 256


def test_scratch_shapes_follow_the_grid():
    g = AttentionGrid(3, 4, 2)
    assert attention_scratch_shapes(g, 2, 8, 5, 16) == ((2, 8, 5, 3, 16), (2, 8, 5, 3, 2), (4, 2))


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"batch": 0}, nbkv.InvalidArgumentError, "batch"),
        ({"num_heads": 6, "num_kv_heads": 4}, nbkv.InvalidArgumentError, "multiple"),
        ({"span": 1.5}, nbkv.ArgumentTypeError, "span"),
        ({"sm_count": None}, nbkv.ArgumentTypeError, "sm_count"),
        ({"splits": 0}, nbkv.InvalidArgumentError, "splits"),
        ({"tile": 2**40}, nbkv.InvalidArgumentError, "tile"),
    ],
)
def test_bad_sizes_are_typed_errors(kwargs, error, fragment):
    args = dict(batch=1, num_heads=8, num_kv_heads=2, n_q=1, span=10, sm_count=1) | kwargs
    with pytest.raises(error, match=fragment):
        attention_grid(**args)


def test_override_tunables_sets_and_restores_even_after_an_error():
    before = nbkv.tunables()
    with nbkv.override_tunables(ATTENTION_SPLITS=3, MAX_BLOCKS=7) as now:
        assert now["ATTENTION_SPLITS"] == 3 and nbkv.tunables()["MAX_BLOCKS"] == 7
        assert attention_grid(1, 8, 2, 1, 100, sm_count=1).splits == 3  # read per call
        assert launch_config(10**6)[0] == 7
    assert nbkv.tunables() == before
    with pytest.raises(RuntimeError), nbkv.override_tunables(ATTENTION_PARALLEL_MIN=1):
        raise RuntimeError("the block fails")
    assert nbkv.tunables() == before


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"ATTENTION_ROWS": 8}, nbkv.InvalidArgumentError, "fixed when the kernels"),
        ({"FASTMATH": set()}, nbkv.InvalidArgumentError, "fixed"),
        ({"NOPE": 1}, nbkv.InvalidArgumentError, "unknown tunable"),
        ({"ATTENTION_SPLITS": 0}, nbkv.InvalidArgumentError, "ATTENTION_SPLITS"),
        ({"MAX_BLOCKS": None}, nbkv.ArgumentTypeError, "MAX_BLOCKS"),
        ({"THREADS_PER_BLOCK": 100}, nbkv.InvalidArgumentError, "multiple of the 32"),
        ({"THREADS_PER_BLOCK": 2048}, nbkv.InvalidArgumentError, "1024"),
        ({"ATTENTION_BLOCKS_PER_SM": True}, nbkv.ArgumentTypeError, "positive int"),
    ],
)
def test_bad_overrides_change_nothing(kwargs, error, fragment):
    before = nbkv.tunables()
    with pytest.raises(error, match=fragment):
        with nbkv.override_tunables(ATTENTION_PARALLEL_MIN=5, **kwargs):
            pass
    assert nbkv.tunables() == before
