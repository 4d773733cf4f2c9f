"""nbkv.models.train: the corpus, a few training steps, and what they write.

The real run takes most of an hour; here a few steps on a tiny corpus check the whole
path: the torch model, the files it writes, that nbkv's Llama loads them and scores the
held-out text through its cache exactly as the training run scored it, and that a run is
reproducible from its seed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import cpu_only

pytestmark = cpu_only
torch = pytest.importorskip("torch")

from nbkv.models import Llama  # noqa: E402
from nbkv.models import train as T  # noqa: E402
from nbkv.models.evaluate import bits_per_byte  # noqa: E402

SNIPPETS = [
    b"def add(a, b):\n    return a + b\n",
    b"class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    b"import os\n\nfor name in os.listdir('.'):\n    print(name)\n",
    b"if __name__ == '__main__':\n    main()\n",
]


def tiny_corpus() -> T.Corpus:
    train = np.concatenate([T._tokens(s) for s in SNIPPETS[:3]] * 8)
    return T.Corpus("snippets", train, [T._tokens(SNIPPETS[3])], 3, 1)


TINY = T.Options(steps=4, batch=2, context=32, warmup=2, eval_every=2, threads=1)


def test_the_corpus_leaves_out_tests_and_holds_out_a_stable_two_percent():
    files = T.corpus_files()
    assert files and files == sorted(files)
    assert not any(p.split("/")[0] in ("test", "idlelib") or "/tests/" in f"/{p}" for p in files)
    held = [p for p in files if T.is_held_out(p)]
    assert 0.005 < len(held) / len(files) < 0.05
    assert [T.is_held_out(p) for p in held] == [True] * len(held)  # a pure function of the path


def test_a_few_steps_write_a_model_that_nbkv_scores_as_the_training_run_did(tmp_path):
    record = T.train(TINY, tmp_path, corpus=tiny_corpus(), log=lambda *a: None)
    assert {p.name for p in tmp_path.iterdir()} == {
        "model.safetensors",
        "config.json",
        "training.json",
    }
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved == record and saved["steps"] == 4 and saved["tokens_seen"] == 4 * 2 * 32
    for key in ("python", "torch", "wall_seconds", "train_bits_per_byte", "corpus"):
        assert key in saved
    model = Llama.from_pretrained(tmp_path)
    # the same held-out bytes, through nbkv's cache (prefill chunks, then decode steps)
    got = bits_per_byte(
        model, tiny_corpus().held_out, context=32, prefill=16, chunk=5, progress=None
    )
    assert got.bits_per_byte == pytest.approx(record["held_out_bits_per_byte"], abs=2e-4)
    assert got.bytes == len(T._tokens(SNIPPETS[3])) - 1


def test_a_run_is_reproducible_from_its_seed(tmp_path):
    corpus = tiny_corpus()
    for name in ("a", "b"):
        T.train(TINY, tmp_path / name, corpus=corpus, log=lambda *a: None)
    a, b = ((tmp_path / n / "model.safetensors").read_bytes() for n in "ab")
    assert a == b
    T.train(
        TINY.__class__(**{**TINY.__dict__, "seed": 1}),
        tmp_path / "c",
        corpus=corpus,
        log=lambda *a: None,
    )
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != a


def test_the_torch_model_and_nbkvs_llama_compute_the_same_logits(tmp_path):
    from nbkv.models import DEFAULT_CONFIG

    model = T.build_model(DEFAULT_CONFIG)
    ids = np.frombuffer(b"while True:\n    pass\n", np.uint8).astype(np.int64)[None]
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    got = Llama(DEFAULT_CONFIG, T.state_arrays(model)).forward_nocache(ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_command_line_runs(tmp_path, capsys):
    # a real corpus, two steps: the entry point the README documents
    assert T.main(["--out", str(tmp_path), "--steps", "2", "--batch", "1", "--context", "16",
                   "--eval-every", "0", "--eval-limit", "3", "--threads", "1"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "training.json").read_text())["steps"] == 2
    assert "held-out" in capsys.readouterr().out
