"""The README's Python examples run (all but the GPU one, which needs a device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import nbkv

from conftest import cpu_only

pytestmark = cpu_only

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    code = BLOCKS[index]
    if 'device="cuda"' in code:
        pytest.skip("the GPU example needs a device and device arrays")
    if "past_key_values" in code:
        pytest.skip("the transformers example needs a model; tests/test_hf.py runs it")
    namespace: dict = {}
    exec(compile(code, f"README.md block {index}", "exec"), namespace)
    if "decode" in namespace:  # the @njit example: call it as the README describes
        import numpy as np

        rng = np.random.default_rng(1)
        ks = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
        k_cache = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)
        v_cache = k_cache.copy()
        assert namespace["decode"](ks, 2 * ks, 1, k_cache, v_cache) == 4
        np.testing.assert_array_equal(v_cache[:, :, 1:4], 2 * ks)
    if isinstance(namespace.get("model"), nbkv.KVCache):  # the "Using it" example
        assert namespace["cache"].seq_len == 512 and namespace["model"].seq_len == 0
