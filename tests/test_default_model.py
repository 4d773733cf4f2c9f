"""The shipped default model: its files, what it learned, and decoding it through the cache."""

from __future__ import annotations

import hashlib
import io
import itertools
import json

import numpy as np
import pytest

import nbkv
from nbkv.models import DEFAULT_CONFIG, DEFAULT_MODEL_DIR, Llama, default_weights
from nbkv.models import weights as model_weights
from nbkv.models.evaluate import bits_per_byte
from nbkv.models.train import held_out_windows, load_corpus

from conftest import cpu_only

pytestmark = cpu_only


def test_the_shipped_files_are_what_nbkv_expects():
    weights = (DEFAULT_MODEL_DIR / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == model_weights.DEFAULT_WEIGHTS_SHA256
    assert len(weights) < 8 * 2**20  # a few MB: float16
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert nbkv.models.LlamaConfig.from_dict(config) == DEFAULT_CONFIG
    record = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())
    assert record["held_out_bits_per_byte"] <= 2.0 and record["steps"] > 0
    assert record["corpus"]["held_out_files"] > 0 and record["wall_seconds"] < 3600
    assert Llama.from_pretrained(DEFAULT_MODEL_DIR).num_parameters == Llama.default().num_parameters


def test_a_damaged_install_is_refused(monkeypatch):
    model_weights.shipped_weights.cache_clear()
    monkeypatch.setattr(model_weights, "DEFAULT_WEIGHTS_SHA256", "0" * 64)
    try:
        with pytest.raises(nbkv.InvalidArgumentError, match="damaged"):
            Llama.default()
    finally:
        monkeypatch.undo()
        model_weights.shipped_weights.cache_clear()
    assert Llama.default().config == DEFAULT_CONFIG


def held_out(name: str) -> np.ndarray:
    corpus = load_corpus()
    return corpus.held_out[corpus.held_out_names.index(name)].astype(np.int64)


def held_out_snippet(n: int = 300) -> np.ndarray:
    return held_out("glob.py")[:n]


def test_cached_decoding_of_held_out_code_is_the_full_forward_pass():
    model = Llama.default()
    ids = held_out_snippet()[None]
    full = model.forward_nocache(ids)
    cache = model.new_cache(max_seq_len=ids.shape[1])
    parts = [model.forward(ids[:, :100], cache), model.forward(ids[:, 100:164], cache)]
    parts += [model.forward(ids[:, t : t + 1], cache) for t in range(164, ids.shape[1])]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-4, atol=1e-4)


def test_it_has_learned_python():
    model = Llama.default()
    # held-out code it never trained on: far below the 8 bits of knowing nothing
    r = bits_per_byte(model, [held_out_snippet(1024)], progress=None)
    assert r.bits_per_byte < 2.5
    seeded = bits_per_byte(Llama.seeded(), [held_out_snippet(512)], progress=None)
    assert seeded.bits_per_byte > 6  # the random model of the same shape knows nothing
    prompt = np.frombuffer(b"def __init__(self", np.uint8).astype(np.int64)
    text = bytes(model.generate(prompt, 40, eos_token_id=None)[0].astype(np.uint8).tolist())
    assert text.isascii() and b"\n" in text  # Python-looking: printable lines of code


def test_the_held_out_figure_is_what_the_training_run_recorded():
    """The first held-out windows, through the cache, against the torch evaluation of the
    same windows with the same float16 weights (the record covers them all)."""
    torch = pytest.importorskip("torch")
    from nbkv.models.train import bits_per_byte_windows, build_model

    model = build_model(DEFAULT_CONFIG)
    model.load_state_dict({n: torch.from_numpy(a) for n, a in default_weights().items()})
    head = held_out("inspect.py")[: 3 * 512 + 1]  # three windows of 512 (overlapping by one)
    want = bits_per_byte_windows(model, list(held_out_windows([head], 512)))
    got = bits_per_byte(Llama.default(), [head], progress=None)
    assert got.windows == 3 and got.bits_per_byte == pytest.approx(want, abs=2e-4)


def test_the_seeded_model_is_deterministic_varied_and_cache_consistent():
    model = Llama.seeded()
    assert model.config == DEFAULT_CONFIG
    prompt = np.frombuffer(b"The quick brown ", np.uint8).astype(np.int64)
    out = model.generate(prompt, 48, eos_token_id=None)
    np.testing.assert_array_equal(out, Llama.seeded().generate(prompt, 48, eos_token_id=None))
    new = out[0, 16:].tolist()
    assert len(set(new)) > 24, new  # not one token (or a short cycle) forever
    assert max(len(list(run)) for _, run in itertools.groupby(new)) <= 4, new
    full = model.forward_nocache(out[:, :-1])
    np.testing.assert_array_equal(full[0, 15:].argmax(-1), out[0, 16:])
    assert not np.array_equal(
        Llama.seeded(1).generate(prompt, 8), Llama.seeded(0).generate(prompt, 8)
    )


def test_python_m_nbkv_eval_reports_bits_per_byte(capsys):
    from nbkv.__main__ import main

    assert main(["eval", "--limit-bytes", "1500", "--context", "128", "--prefill", "64"]) == 0
    out = capsys.readouterr().out
    assert "bits per byte over" in out and "Llama.default() (shipped)" in out
    assert main(["eval", "--context", "0"]) == 2  # a typed error, reported


def test_bits_per_byte_checks_its_arguments():
    model = Llama.default()
    for kwargs, error in (
        ({"context": 0}, nbkv.InvalidArgumentError),
        ({"prefill": 600}, nbkv.InvalidArgumentError),
        ({"chunk": 1.5}, nbkv.ArgumentTypeError),
    ):
        with pytest.raises(error):
            bits_per_byte(model, [np.arange(10)], progress=None, **kwargs)
    with pytest.raises(nbkv.ArgumentTypeError):
        bits_per_byte(model, [np.ones((2, 2), np.int64)], progress=None)
    with pytest.raises(nbkv.InvalidArgumentError):
        bits_per_byte(model, [np.array([300])], progress=None)
    bar = io.StringIO()
    bits_per_byte(model, [np.arange(40)], context=16, prefill=8, chunk=4, progress=bar)
    assert "bits/byte so far" in bar.getvalue()
