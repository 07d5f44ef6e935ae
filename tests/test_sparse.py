"""Positional sparse prefill: exactness, true positions, validation."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from dflash.engine import sparse
from helpers import cut_at_eos, greedy_reference, run_dflash

TEXT = ("Once upon a time there was a small town by the sea where fishermen mended their nets "
        "at dawn. The quick brown fox jumps over the lazy dog. ") * 3


class MaskedKVCache(KVCache):
    """Reference: keep every token in place but hide the unselected ones from all queries."""

    def __init__(self, hidden: set[int]):
        super().__init__()
        self.hidden = hidden

    def make_mask(self, N, window_size=None, return_array=False, **_):
        q = mx.arange(self.offset, self.offset + N)[:, None]
        k = mx.arange(self.offset + N)[None]
        visible = mx.array([i not in self.hidden for i in range(self.offset + N)])[None]
        return (k <= q) & visible


def masked_reference(model, ids, selected, n_new):
    """Greedy decode of the full prompt with unselected tokens masked out (a second computation)."""
    hidden = set(range(len(ids))) - set(selected)
    cache = [MaskedKVCache(hidden) for _ in model.layers]
    logits = model(mx.array(ids)[None], cache=cache)
    out = []
    tok = mx.argmax(logits[0, -1]).item()
    for _ in range(n_new):
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
        tok = mx.argmax(logits[0, -1]).item()
    return out


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_select_all_is_bitwise_dense(pairs, arch):
    pair = pairs(arch)
    t = pair.target
    ids = pair.tokenizer.encode(TEXT)
    dense = t.make_cache()
    ld, fd = t.forward(mx.array(ids)[None], dense)
    pos = sparse.positioned(t.make_cache())
    sparse.jump(pos, 0)
    ls, fs = t.forward(mx.array(ids)[None], pos)
    assert mx.array_equal(ld, ls) and mx.array_equal(fd, fs)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "gemma3_text"])
def test_select_all_generates_like_dense(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(TEXT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 48), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(
        pair.target, pair.drafter, pair.tokenizer, None, 48,
        prompt_tokens_override=ids, prompt_token_positions=list(range(len(ids))),
    )
    assert final.token_ids == ref
    assert final.stats.warnings == []


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_chunked_selection_uses_true_positions(pairs, arch):
    """Two chunks with a gap, then decoding: equal to the masked full-prompt reference."""
    pair = pairs(arch)
    ids = pair.tokenizer.encode(TEXT)
    n = len(ids)
    selected = list(range(0, 20)) + list(range(n - 30, n))
    ref = masked_reference(pair.target.model, ids, selected, 40)
    ref = cut_at_eos(ref, set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(
        pair.target, pair.drafter, pair.tokenizer, None, 40,
        prompt_tokens_override=[ids[i] for i in selected], prompt_token_positions=selected,
    )
    assert final.token_ids == ref
    # and it is not what the compacted prompt at positions 0.. would give
    compact = greedy_reference(pair.target.model, [ids[i] for i in selected], 40)
    assert compact != ref


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text", "qwen3_5_moe"])
def test_chunked_selection_runs_on_hybrid_and_window(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(TEXT)
    n = len(ids)
    selected = list(range(0, 16)) + list(range(40, 56)) + list(range(n - 24, n))
    final, _ = run_dflash(
        pair.target, pair.drafter, pair.tokenizer, None, 40,
        prompt_tokens_override=[ids[i] for i in selected], prompt_token_positions=selected,
    )
    assert final.stats.prompt_tokens == len(selected)
    assert 0 < len(final.token_ids) <= 40


def test_window_cache_masks_by_true_position():
    z = lambda n: mx.zeros((1, 1, n, 2))  # noqa: E731
    c = sparse.PositionedWindowCache(window=4)
    c.update_and_fetch(z(3), z(3))  # positions 0, 1, 2
    c.jump(10)
    # queries at 10, 11: keys <= 10-4 are dropped; causal among the new ones
    assert c.make_mask(2).tolist() == [[True, False], [True, True]]
    c.update_and_fetch(z(2), z(2))
    assert c.positions == [10, 11]
    c.jump(13)
    c.update_and_fetch(z(1), z(1))  # position 13; keys 10, 11, 13
    # queries 14, 15 over kept keys (11, 13: 10 <= 14-4 is dropped) + 14, 15
    assert c.make_mask(2).tolist() == [[True, True, True, False], [False, True, True, True]]
    assert c.trim(1) == 1 and c.positions == [10, 11] and c.offset == 13


def test_scatter_warning_and_chunk_helper():
    assert sparse.scatter_warning(list(range(0, 200, 2))) is not None
    sel = sparse.select_chunks(2000, chunk=64, head=64, tail=256, every=4)
    assert sel[:64] == list(range(64)) and sel[-256:] == list(range(1744, 2000))
    assert sparse.scatter_warning(sel) is None
    assert sel == sorted(set(sel))


@pytest.mark.parametrize(
    "ids,positions,msg",
    [
        ([1, 2], [0], "same length"),
        ([1, 2], [3, 3], "strictly increasing"),
        ([1, 2], [5, 2], "strictly increasing"),
        ([1], [-1], ">= 0"),
        ([], [], "empty"),
    ],
)
def test_invalid_selections_are_refused(pairs, ids, positions, msg):
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match=msg):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, None, 8,
                   prompt_tokens_override=ids, prompt_token_positions=positions)
    with pytest.raises(ValueError, match="both"):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, None, 8, prompt_tokens_override=[1])
