"""scripts/near_ties.py: its replay is mlx-lm's greedy decode, and the gaps it reports are the
target's top-1 minus top-2 logits there."""

from __future__ import annotations


import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from helpers import greedy_reference, load_script


def _script():
    return load_script("near_ties")


def test_replay_is_mlx_lm_greedy_and_gaps_are_top2(tiny_dirs):
    model, _ = load(str(tiny_dirs["llama"]))
    prompt = [3, 17, 42, 9, 5, 88]
    ids, gaps = _script().greedy_with_gaps(model, prompt, 12)
    assert ids == greedy_reference(model, prompt, 12)
    assert len(gaps) == 12 and all(g >= 0 for g in gaps)
    # the gap at a position: the logits after prompt + ids[:k], recomputed in one pass
    k = 5
    row = model(mx.array(prompt + ids[:k])[None], cache=make_prompt_cache(model))[0, -1]
    top = mx.sort(row.astype(mx.float32))[-2:].tolist()
    assert abs((top[1] - top[0]) - gaps[k]) < 1e-3
