"""nbkv.serving.Engine: continuous batching equals Llama.generate run alone on each prompt,
through chunked prefill, prefix hits, end tokens and preemption; on this run's backend."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.models import Llama
from nbkv.serving import Engine

from conftest import DEVICE

SIM = DEVICE == "cuda"  # the simulator runs every CUDA thread in Python: fewer tokens
NEW = 4 if SIM else 16
EOS = 10  # newline: the trained model ends lines, so some requests stop early


@pytest.fixture(scope="module")
def model():
    return Llama.default()


def prompts_of(rng, n, shared=0):
    """``n`` prompts of mixed lengths; every other one starts with a common prefix."""
    prefix = rng.integers(32, 127, shared)
    out = []
    for i in range(n):
        own = rng.integers(32, 127, int(rng.integers(1, 12 if SIM else 40)))
        out.append(np.concatenate([prefix, own]) if i % 2 and shared else own)
    return out


def alone(model, prompts, **kw):
    return [model.generate(p, NEW, eos_token_id=EOS, **kw)[0] for p in prompts]


@pytest.mark.parametrize(
    "options",
    [
        {},  # everything fits: one step prefills all, then decodes together
        {"num_blocks": 40, "block_size": 4, "max_batch_tokens": 9, "max_seqs": 3},  # chunks
        {"num_blocks": 8 if SIM else 24, "block_size": 4, "max_batch_tokens": 64},  # preempts
        {"num_blocks": 20, "block_size": 8, "prefix_caching": False, "max_batch_tokens": 5},
    ],
    ids=["roomy", "chunked", "preempting", "no-prefix-cache"],
)
def test_greedy_outputs_equal_generate_alone(model, rng, options):
    prompts = prompts_of(rng, 4 if SIM else 8, shared=8 if SIM else 24)
    engine = Engine(model, device=DEVICE, **options)
    got = engine.generate(prompts, max_new_tokens=NEW, eos_token_id=EOS)
    for g, w in zip(got, alone(model, prompts), strict=True):
        np.testing.assert_array_equal(g, w)
    s = engine.cache.stats()
    assert s["blocks_used"] == 0 and s["positions"] == 0  # every sequence was freed
    assert not engine.has_unfinished()
    if "max_batch_tokens" in options:
        assert max(r.num_tokens for r in engine.history) <= max(
            options["max_batch_tokens"], engine.history[0].num_seqs
        )
    if options.get("max_batch_tokens") == 64:
        assert engine.preemptions > 0  # the small pool forced a recompute


def test_requests_arriving_later_reuse_the_cached_prefix(model, rng):
    engine = Engine(model, num_blocks=64, block_size=4, device=DEVICE)
    system = rng.integers(32, 127, 20)
    first = engine.add_request(np.concatenate([system, [65]]), max_new_tokens=2)
    done = {}
    while engine.has_unfinished():
        done.update(engine.step())
    later = [np.concatenate([system, rng.integers(32, 127, 3)]) for _ in range(3)]
    outs = engine.generate(later, max_new_tokens=2)
    assert engine.cache.stats()["prefix_hit_tokens"] == 3 * 20  # 5 full blocks each
    for o, p in zip(outs, later, strict=True):
        np.testing.assert_array_equal(o, model.generate(p, 2, eos_token_id=None)[0])
    assert first in done


@pytest.mark.skipif(SIM, reason="sampling is checked on the CPU")
def test_seeded_sampling_draws_as_generate_does(model, rng):
    prompts = prompts_of(rng, 3)
    engine = Engine(model, num_blocks=64)
    rids = [
        engine.add_request(p, max_new_tokens=12, temperature=0.8, seed=i)
        for i, p in enumerate(prompts)
    ]
    out = {}
    while engine.has_unfinished():
        out.update(engine.step())
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        want = model.generate(p, 12, temperature=0.8, seed=i, eos_token_id=None)[0]
        np.testing.assert_array_equal(out[rid], want)


def test_max_new_tokens_zero_returns_the_prompt_and_step_reports_finishes(model):
    engine = Engine(model, num_blocks=8)
    rid = engine.add_request(np.array([1, 2, 3]), max_new_tokens=0)
    ((got, ids),) = engine.step()
    assert got == rid and ids.tolist() == [1, 2, 3] and not engine.has_unfinished()
    assert engine.step() == []  # nothing left: an empty step
    other = engine.add_request(np.array([4]), max_new_tokens=2)
    out = {}
    while engine.has_unfinished():
        out.update(engine.step())
    assert list(out) == [other] and len(out[other]) == 3
    t = engine.times(other)
    assert t["added"] <= t["first_token"] <= t["finished"]


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda e: e.add_request(np.arange(200), max_new_tokens=1), nbkv.OutOfBlocksError),
        (
            lambda e: e.add_request(np.array([[1, 2], [3, 4]]), max_new_tokens=1),
            nbkv.InvalidArgumentError,
        ),  # fmt: skip
        (lambda e: e.add_request(np.array([300]), max_new_tokens=1), nbkv.InvalidArgumentError),
        (lambda e: e.add_request(np.array([1]), max_new_tokens=-1), nbkv.InvalidArgumentError),
        (lambda e: e.add_request(np.array([1]), max_new_tokens=1.5), nbkv.ArgumentTypeError),
        (
            lambda e: e.add_request(np.array([1]), max_new_tokens=1, temperature=-1),
            nbkv.InvalidArgumentError,
        ),  # fmt: skip
        (
            lambda e: e.add_request(np.array([1]), max_new_tokens=1, eos_token_id="x"),
            nbkv.InvalidArgumentError,
        ),  # fmt: skip
        (lambda e: e.add_request("abc", max_new_tokens=1), nbkv.ArgumentTypeError),
    ],
)
def test_bad_requests_are_typed_errors_that_queue_nothing(model, call, error):
    engine = Engine(model, num_blocks=8, block_size=4)
    engine.add_request(np.array([5, 6]), max_new_tokens=1)
    with pytest.raises(error):
        call(engine)
    assert engine.num_waiting == 1
    assert len(engine.generate([np.array([7])], max_new_tokens=1)) == 1


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_blocks": 0}, nbkv.InvalidArgumentError),
        ({"block_size": 0}, nbkv.InvalidArgumentError),
        ({"max_batch_tokens": 0}, nbkv.InvalidArgumentError),
        ({"max_seqs": "4"}, nbkv.ArgumentTypeError),
        ({"prefix_caching": 1}, nbkv.ArgumentTypeError),
        ({"device": "tpu"}, nbkv.InvalidArgumentError),
    ],
)
def test_bad_engines_are_typed_errors(model, kwargs, error):
    with pytest.raises(error):
        Engine(model, **kwargs)
    with pytest.raises(nbkv.ArgumentTypeError):
        Engine(object())


def test_forward_paged_checks_its_step_and_ids(model, rng):
    c = model.config
    cache = nbkv.PagedKVCache(8, 4, num_layers=c.num_hidden_layers, num_kv_heads=2,
                              head_dim=c.head_dim, dtype="float32", device=DEVICE)  # fmt: skip
    a = cache.add()
    step = cache.reserve({a: 3})
    with pytest.raises(nbkv.ShapeMismatchError):
        model.forward_paged(np.array([1, 2]), cache, step)
    logits = model.forward_paged(np.array([1, 2, 3]), cache, step)
    want = model.forward_nocache(np.array([1, 2, 3]))[0, -1]
    np.testing.assert_allclose(logits[0], want, atol=1e-4)
    cache.reserve({a: 1})
    with pytest.raises(nbkv.StaleStepError):
        model.forward_paged(np.array([1, 2, 3]), cache, step)
    small = nbkv.PagedKVCache(8, 4, num_kv_heads=2, head_dim=c.head_dim, dtype="float32")
    with pytest.raises(nbkv.ShapeMismatchError):
        model.forward_paged(np.array([1]), small, small.reserve({small.add(): 1}))


def test_a_step_interrupted_in_its_forward_pass_is_taken_back(model, rng, monkeypatch):
    """forward_paged raising (an interrupt) leaves every sequence as it was before the
    step, and serving continues to the same outputs."""
    prompts = prompts_of(rng, 3)
    engine = Engine(model, num_blocks=64, block_size=4, device=DEVICE)
    rids = [engine.add_request(p, max_new_tokens=NEW, eos_token_id=EOS) for p in prompts]
    done = dict(engine.step())
    before = {s: engine.cache.seq_len(s) for s in engine.cache.seq_ids}
    real, calls = type(model).forward_paged, [0]

    def failing(self, *args):
        calls[0] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "forward_paged", failing)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.setattr(type(model), "forward_paged", real)
    assert calls[0] == 1 and {s: engine.cache.seq_len(s) for s in engine.cache.seq_ids} == before
    while engine.has_unfinished():
        done.update(engine.step())
    for rid, w in zip(rids, alone(model, prompts), strict=True):
        np.testing.assert_array_equal(done[rid], w)


def test_generate_is_all_or_nothing_and_keeps_other_requests_results(model):
    engine = Engine(model, num_blocks=16, block_size=4, device=DEVICE)
    other = engine.add_request(np.array([40, 41]), max_new_tokens=2)
    with pytest.raises(nbkv.OutOfBlocksError):
        engine.generate([np.array([1, 2]), np.arange(100) % 90], max_new_tokens=2)
    assert engine.num_waiting == 1  # only the request added before
    outs = engine.generate([np.array([50])], max_new_tokens=2)
    assert len(outs) == 1 and len(outs[0]) == 3
    assert engine.has_unfinished()  # `other` finished meanwhile: held for step()
    ((rid, ids),) = engine.step()
    assert rid == other and len(ids) == 4 and not engine.has_unfinished()


def test_waiting_requests_do_not_count_prefix_queries_until_admitted(model, rng):
    """A request that waits for blocks is looked up (match), not added and freed: the
    prefix-cache statistics count each admission once."""
    engine = Engine(model, num_blocks=12, block_size=4, max_seqs=8, device=DEVICE)
    prompts = [rng.integers(32, 127, 12) for _ in range(6)]
    engine.generate(prompts, max_new_tokens=NEW)
    s = engine.cache.stats()
    admitted = sum(len(p) for p in prompts) + engine.preemptions * (12 + NEW)
    assert s["prefix_query_tokens"] <= admitted
