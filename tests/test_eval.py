"""nbkv.eval: the accuracy harness (KL divergence, top-1, bits per byte against float32)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import nbkv
from nbkv.eval import KVSpec, Row, Session, cache_factory, compare, format_table
from nbkv.models import Llama

from conftest import cpu_only

pytestmark = cpu_only

TEXT = (
    b"def window(tokens, size):\n"
    b"    out = []\n"
    b"    for start in range(0, len(tokens) - 1, size):\n"
    b"        out.append(tokens[start : start + size + 1])\n"
    b"    return out\n\n"
    b"class Cache:\n"
    b"    def __init__(self, n):\n"
    b"        self.n = n\n"
    b"        self.rows = []\n"
)  # 240 bytes
SETTINGS = dict(context=64, prefill=32, chunk=16, progress=None)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.default()


def by_name(rows: list[Row]) -> dict[str, Row]:
    return {r.name: r for r in rows}


def test_the_reference_against_itself_is_exact_and_fp16_is_a_small_noise_floor(model):
    rows = compare(model, ["fp32"], [TEXT], **SETTINGS)
    assert [r.name for r in rows] == ["reference", "fp16", "fp32"]
    ref, fp16, fp32 = rows
    assert "noise floor" in fp16.description and "reference" in ref.description
    assert (fp32.kl_mean, fp32.kl_p99, fp32.kl_max, fp32.top1) == (0.0, 0.0, 0.0, 1.0)
    assert fp32.bits_per_byte == ref.bits_per_byte and fp32.delta_bits_per_byte == 0.0
    assert 0 < fp16.kl_mean < 1e-3 and fp16.kl_mean <= fp16.kl_p99 <= fp16.kl_max
    assert fp16.top1 >= 0.95
    assert all(r.bytes == len(TEXT) - 1 for r in rows)  # every byte after the first
    assert fp16.nbytes == ref.nbytes // 2  # 16-bit storage, same capacity
    assert 0 < ref.bits_per_byte < 8


def test_the_reference_matches_the_held_out_bits_per_byte_evaluation(model):
    from nbkv.models.evaluate import bits_per_byte

    text = np.frombuffer(TEXT, np.uint8)
    ref = compare(model, [], [text], **SETTINGS)[0]
    other = bits_per_byte(model, [text], context=64, prefill=32, chunk=16, progress=None)
    assert ref.bytes == other.bytes
    assert ref.bits_per_byte == pytest.approx(other.bits_per_byte, rel=1e-6)


def test_the_noise_floor_row_comes_once_even_when_asked_for(model):
    rows = compare(model, ["ring64", "fp16", "ring64"], [TEXT], **SETTINGS)
    assert [r.name for r in rows] == ["reference", "fp16", "ring64"]


def test_a_paged_cache_reproduces_the_reference_to_float32_rounding(model):
    paged = by_name(compare(model, ["paged16", "paged5"], [TEXT], **SETTINGS))
    for name in ("paged16", "paged5"):  # blocks that divide the window, and that do not
        assert paged[name].kl_mean < 1e-6 and paged[name].top1 == 1.0
        assert paged[name].delta_bits_per_byte == pytest.approx(0, abs=1e-5)


def test_a_ring_covering_the_context_matches_and_a_small_ring_differs(model):
    rows = by_name(compare(model, ["ring64", "ring100s4", "ring16s2"], [TEXT], **SETTINGS))
    for name in ("ring64", "ring100s4"):  # nothing ever leaves the ring
        assert rows[name].kl_mean < 1e-6 and rows[name].top1 == 1.0
    small = rows["ring16s2"]  # 14 recent positions and 2 sinks: it forgets
    assert small.kl_mean > 10 * rows["fp16"].kl_mean and small.kl_max > 1e-2
    assert small.nbytes == rows["reference"].nbytes * 16 // 64


class Recompute:
    """A Session with no cache at all: the whole window recomputed each call."""

    def __init__(self, model: Llama) -> None:
        self.model, self.seen = model, np.empty(0, np.int64)

    def forward(self, ids):
        self.seen = np.concatenate([self.seen, ids])
        return self.model.forward_nocache(self.seen[None])[0, -len(ids) :]


def test_a_user_factory_may_return_a_kvcache_or_a_session(model):
    def half(model, n):
        return model.new_cache(1, n, dtype="float16")

    half.description = "my float16 cache"
    assert isinstance(Recompute(model), Session)
    kvs = {"half": half, "nocache": lambda model, n: Recompute(model), "p8": "paged8"}
    rows = by_name(compare(model, kvs, [TEXT], **SETTINGS))
    assert list(rows) == ["reference", "fp16", "half", "nocache", "p8"]
    assert rows["half"].description == "my float16 cache"
    assert rows["half"][2:9] == rows["fp16"][2:9]  # the same cache: the same numbers
    assert rows["nocache"].kl_mean < 1e-6 and rows["nocache"].nbytes is None
    assert rows["nocache"].description == "your factory"
    assert rows["p8"].description == "paged, blocks of 8"


def test_limit_bytes_cuts_the_files_in_order(model):
    rows = compare(model, [], [TEXT, TEXT], limit_bytes=300, **SETTINGS)
    assert rows[0].bytes == (len(TEXT) - 1) + (300 - len(TEXT) - 1)


def test_the_progress_bar_counts_bytes_over_all_windows(model):
    out = io.StringIO()
    compare(model, [], [TEXT], **{**SETTINGS, "progress": out})
    assert f"] {len(TEXT) - 1:,}/{len(TEXT) - 1:,} bytes" in out.getvalue()


@pytest.mark.parametrize(
    "name, want",
    [
        ("fp32", KVSpec("fp32", "float", dtype="float32")),
        (" BF16 ", KVSpec("bf16", "float", dtype="bfloat16")),
        ("int8", KVSpec("int8", "quantized", bits=(8, 8))),
        (
            "int4-g32-r64",
            KVSpec("int4-g32-r64", "quantized", bits=(4, 4), group_size=32, residual=64),
        ),
        ("int2-r0", KVSpec("int2-r0", "quantized", bits=(2, 2), residual=0)),
        ("k4v2", KVSpec("k4v2", "quantized", bits=(4, 2))),
        ("k8v4-g32-r0", KVSpec("k8v4-g32-r0", "quantized", bits=(8, 4), group_size=32, residual=0)),
        ("ring128", KVSpec("ring128", "ring", window=128)),
        ("ring128s4", KVSpec("ring128s4", "ring", window=128, sinks=4)),
        ("paged16", KVSpec("paged16", "paged", block_size=16)),
    ],
)
def test_the_grammar_parses_every_kind(name, want):
    assert cache_factory(name) == want


@pytest.mark.parametrize(
    "name",
    ["", "fp8", "int3", "int16", "k4", "k4v3", "int4-g0", "int4-x3", "int4-g32-g16", "fp16-g32",
     "ring", "ring0", "ring8s8", "ring8s9", "paged", "paged0", "paged16s2", "ring-8"],
)  # fmt: skip
def test_a_bad_name_is_a_typed_error_naming_it(name):
    with pytest.raises(nbkv.InvalidArgumentError, match="kvs\\[3\\]") as err:
        cache_factory(name, argument="kvs[3]")
    assert repr(name) in str(err.value)


def test_a_name_that_is_not_a_str_is_a_type_error():
    with pytest.raises(nbkv.ArgumentTypeError, match="name must be a str"):
        cache_factory(8)


class Counting:
    calls = 0

    def __call__(self, model, n):
        Counting.calls += 1
        return model.new_cache(1, n)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(kvs=["fp16", "int3"]), nbkv.InvalidArgumentError, "kvs\\[1\\]"),
        (dict(kvs=[8]), nbkv.ArgumentTypeError, "kvs\\[0\\]"),
        (dict(kvs=42), nbkv.ArgumentTypeError, "kvs must be"),
        (dict(kvs=[Counting()]), nbkv.ArgumentTypeError, "kvs\\[0\\] is a factory without a name"),
        (dict(kvs={"reference": "fp32"}), nbkv.InvalidArgumentError, "keeps for its own row"),
        (dict(kvs={"fp16": Counting()}), nbkv.InvalidArgumentError, "keeps for its own row"),
        (dict(kvs={3: "fp16"}), nbkv.ArgumentTypeError, "keys must be"),
        (dict(context=0), nbkv.InvalidArgumentError, "context"),
        (dict(context="64"), nbkv.ArgumentTypeError, "context"),
        (dict(prefill=65), nbkv.InvalidArgumentError, "prefill \\(65\\) must be at most"),
        (dict(chunk=-1), nbkv.InvalidArgumentError, "chunk"),
        (dict(limit_bytes=0), nbkv.InvalidArgumentError, "limit_bytes"),
        (dict(files=[np.zeros((2, 2), np.int64)]), nbkv.ArgumentTypeError, "files\\[0\\]"),
        (dict(files=[np.array([1.5, 2.5])]), nbkv.ArgumentTypeError, "files\\[0\\]"),
        (dict(files=[b"ab", np.array([1, 300])]), nbkv.InvalidArgumentError, "files\\[1\\]"),
        (dict(files=b"abc"), nbkv.ArgumentTypeError, "files must be"),
        (dict(files=[b"a"]), nbkv.InvalidArgumentError, "no byte to score"),
        (dict(progress=5), nbkv.ArgumentTypeError, "progress"),
        (dict(model="llama"), nbkv.ArgumentTypeError, "model must be"),
    ],
)
def test_bad_arguments_raise_typed_errors_before_any_cache_is_built(model, kwargs, error, match):
    args = {"model": model, "kvs": {"mine": Counting()}, "files": [TEXT], **SETTINGS, **kwargs}
    Counting.calls = 0
    with pytest.raises(error, match=match):
        compare(**args)
    assert Counting.calls == 0


def test_a_factory_that_builds_no_session_is_a_typed_error(model):
    with pytest.raises(nbkv.ArgumentTypeError, match="'bad' must return an nbkv.KVCache"):
        compare(model, {"bad": lambda model, n: object()}, [TEXT], **SETTINGS)

    class Short:
        def forward(self, ids):
            return np.zeros((1, 256), np.float32)

    with pytest.raises(nbkv.ShapeMismatchError, match="'short' must answer"):
        compare(model, {"short": lambda model, n: Short()}, [TEXT], **SETTINGS)


def test_int8_is_close_and_int2_is_further(model):
    # windows of 64 bytes: groups of 16 and no residual, so that most positions are codes
    names = ["int8-g16-r0", "int2-g16-r0", "int4-g32-r0", "k8v4-g32-r0", "int8"]
    rows = by_name(compare(model, names, [TEXT], **SETTINGS))
    int8, int2 = rows["int8-g16-r0"], rows["int2-g16-r0"]
    assert int8.kl_mean < 1e-2 and int8.top1 >= 0.9
    assert int2.kl_mean > 10 * int8.kl_mean and int2.kl_mean > rows["fp16"].kl_mean
    assert rows["int4-g32-r0"].kl_mean > rows["k8v4-g32-r0"].kl_mean > rows["fp16"].kl_mean
    assert rows["int8"].kl_mean < 1e-6  # a window of 64 never leaves its residual of 128
    assert int2.nbytes < int8.nbytes < rows["reference"].nbytes


def test_format_table_prints_one_line_a_row_under_a_header(model):
    rows = compare(model, ["ring16"], [TEXT], **SETTINGS)
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:4] == ["kv", "cache", "KL", "mean"]
    assert set(lines[1]) == {"-", " "}
    assert [line.split()[0] for line in lines[2:]] == ["reference", "fp16", "ring16"]
    assert "(noise floor)" in lines[3] and "ring of 16, 0 sinks" in lines[4]


def test_the_cli_prints_the_table_and_its_settings(capsys):
    from nbkv.__main__ import main

    argv = ["eval", "--kv", "ring32", "paged16", "--limit-bytes", "300", "--context", "64"]
    assert main([*argv, "--prefill", "32", "--chunk", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[2:6]] == ["reference", "fp16", "ring32", "paged16"]
    assert "noise floor" in out[3]
    settings = out[-1]
    for part in ("299 held-out bytes", "windows of 64", "prefill 32 in chunks of 16", "files"):
        assert part in settings


def test_the_cli_reports_a_bad_kv_name_as_an_error(capsys):
    from nbkv.__main__ import main

    assert main(["eval", "--kv", "fp16", "int3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --kv 'int3'") and "ring<W>" in err
