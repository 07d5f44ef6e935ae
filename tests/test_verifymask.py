"""DFLASH_VERIFY_MASK (engine/verifymask.py): an explicit causal mask array instead of MLX's
"causal" path, for the target's own multi-token forwards only; same attention, same ids."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import ARCHS
from dflash.engine import verifymask
from dflash.engine.loading import load_pair
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n"


def test_the_array_is_the_causal_mask_at_the_end_of_the_cache():
    m = verifymask.causal_array(3, 5)
    assert m.tolist() == [[True, True, True, False, False],
                          [True, True, True, True, False],
                          [True, True, True, True, True]]
    q = mx.random.normal((1, 2, 4, 8), key=mx.random.key(0))
    k = mx.random.normal((1, 2, 9, 8), key=mx.random.key(1))
    v = mx.random.normal((1, 2, 9, 8), key=mx.random.key(2))
    sdpa = mx.fast.scaled_dot_product_attention
    want = sdpa(q, k, v, scale=0.3, mask="causal")
    assert mx.allclose(sdpa(q, k, v, scale=0.3, mask=verifymask.causal_array(4, 9)), want, atol=1e-5)


def test_the_setting_is_parsed_and_a_bad_one_is_a_clear_error(monkeypatch):
    for value, want in (("causal", 0), ("", 0), ("array:4096", 4096)):
        monkeypatch.setenv(verifymask.ENV, value)
        assert verifymask.max_keys() == want
    monkeypatch.setenv(verifymask.ENV, "array")
    assert verifymask.max_keys() > 10**9
    for bad in ("arry", "array:0", "array:x"):
        monkeypatch.setenv(verifymask.ENV, bad)
        with pytest.raises(ValueError, match="DFLASH_VERIFY_MASK"):
            verifymask.max_keys()


@pytest.fixture
def arrays(monkeypatch):
    """Record the mask arrays the wrapper hands MLX (their shapes)."""
    made = []
    real = verifymask.causal_array

    def counting(queries, keys):
        made.append((queries, keys))
        return real(queries, keys)

    monkeypatch.setattr(verifymask, "causal_array", counting)
    return made


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_array_masks_give_mlx_lm_greedy_ids_and_only_in_the_targets_forwards(
        tiny_dirs, monkeypatch, arrays, arch):
    assert arch in ARCHS
    monkeypatch.setenv(verifymask.ENV, "array")
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    assert not arrays, "mlx-lm's own decode was given mask arrays"
    for window in ("full", 3, "auto"):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=window)
        assert final.token_ids == ref, f"{arch}: window {window} diverged from mlx-lm greedy"
    assert arrays and all(q > 1 and k >= q for q, k in arrays)
    n = len(arrays)
    monkeypatch.setenv(verifymask.ENV, f"array:{len(ids) - 1}")  # fewer keys than any verify sees
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")  # the setting is read at load
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window="full")
    assert final.token_ids == ref and len(arrays) == n
