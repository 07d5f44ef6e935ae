"""Branches (engine/branches.py): several greedy draft rows in one verify, the best row kept."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash.engine import branches, rollback
from dflash.engine.drafters import OracleDrafter
from helpers import cut_at_eos, greedy_reference, run_dflash
from conftest import ARCHS

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
N_NEW = 64


def _logits(rows: list[list[float]]) -> mx.array:
    return mx.log(mx.array(rows, dtype=mx.float32))


def test_rows_substitute_where_the_draft_itself_expects_them_to_pay():
    # 3 positions over 4 tokens; top-1 ids 0, 1, 2 with probs .5, .9, .6
    logits = _logits([[.5, .3, .15, .05], [.05, .9, .03, .02], [.1, .2, .6, .1]])
    got = branches.rows_from_logits(logits, 4).tolist()
    # scores: pos 0 rank 1 -> .3; pos 0 rank 2 -> .15; pos 2 rank 1 -> .5*.9*.2 = .09;
    # pos 1 rank 1 -> .5*.05 = .025
    assert got[0] == [0, 1, 2]
    assert sorted(got[1:]) == sorted([[1, 1, 2], [2, 1, 2], [0, 1, 1]])


def test_rows_are_distinct_and_differ_from_the_top_row_once():
    logits = mx.random.normal((15, 50), key=mx.random.key(3))
    got = branches.rows_from_logits(logits, 8).tolist()
    top = mx.argmax(logits, axis=-1).tolist()
    assert len(got) == 8 and got[0] == top
    assert len({tuple(r) for r in got}) == 8
    for r in got[1:]:
        assert sum(a != b for a, b in zip(r, top)) == 1


def test_a_tiny_block_gives_fewer_rows():
    got = branches.rows_from_logits(_logits([[.7, .3]]), 8).tolist()
    assert got == [[0], [1]]


@pytest.mark.parametrize("value,rows", [("", 1), ("1", 1), ("8", 8), (" 4 ", 4)])
def test_setting(monkeypatch, value, rows):
    monkeypatch.setenv(branches.ENV, value)
    assert branches.configure() == rows


def test_unset_means_eight_rows_on_a_cuda_gpu_and_one_on_the_cpu(monkeypatch):
    from dflash.engine import verifyattn

    monkeypatch.delenv(branches.ENV, raising=False)
    assert branches.configure() == 1 and branches.budget() == branches.DEFAULT_BUDGET_BYTES
    monkeypatch.setattr(verifyattn, "cuda", lambda: True)
    assert branches.configure() == branches.MAX_ROWS == 8
    monkeypatch.setenv(branches.ENV, "4")  # asked for: any cache length
    assert branches.configure() == 4 and branches.explicit() and branches.budget() is None


@pytest.mark.parametrize("value", ["0", "9", "auto", "two", "-1"])
def test_bad_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(branches.ENV, value)
    with pytest.raises(ValueError, match=branches.ENV):
        branches.configure()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("window", ["full", "auto"])
def test_branches_equal_greedy(pairs, arch, window):
    """The model draft with 4 rows: mlx-lm's greedy ids; plain KV caches verify the rows, other
    cache kinds one row."""
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, N_NEW), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW,
                          verify_window=window, branches=4)
    assert final.token_ids == ref, f"{arch}: branches diverged from mlx-lm greedy"
    kv = rollback.rows_supported(pair.target.make_cache())
    assert final.stats.branch_rows == (4 if kv else 1)


class _SecondChoiceOracle(OracleDrafter):
    """Row 0 wrong at block position `miss`, row 1 the reference, the rest wrong at position 1:
    only the kept row's tokens, features and cache can give whole blocks."""

    def __init__(self, *args, miss: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.miss = miss

    def propose(self, anchor, anchor_pos, count=None, sampling=None, rows=1):
        right = super().propose(anchor, anchor_pos, count)
        out = []
        for r in range(max(rows, 1)):
            row = right.tolist()
            j = None if r == 1 else (self.miss if r == 0 else 1) - 1
            if j is not None and j < len(row):
                row[j] = (row[j] + 1 + r) % self.vocab_size
            out.append(row)
        return mx.array(out[0] if rows == 1 else out, dtype=mx.int32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_kept_row_is_the_one_accepted_furthest(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, N_NEW + 16)
    drafter = _SecondChoiceOracle(ref, len(ids), 16, vocab_size=pair.target.vocab_size)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        one, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW, verify_window="full",
                            copy_draft=False, branches=1)
        four, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW, verify_window="full",
                             copy_draft=False, branches=4)
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert one.token_ids == four.token_ids == ref[:N_NEW]
    assert one.stats.tokens_per_cycle <= 2.01  # row 0 alone: 1 draft accepted a cycle
    assert four.stats.branch_wins >= four.stats.cycles - 1  # row 1 kept (all but maybe the last)
    assert four.stats.tokens_per_cycle >= 15


def test_sampling_verifies_one_row(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, temperature=0.8,
                          seed=1, branches=4)
    assert final.stats.branch_rows == 1 and final.stats.branch_wins == 0


def test_bad_branches_argument(pairs):
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match="branches"):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, pair.tokenizer.encode(PROMPT), 8,
                   branches=0)


def test_run_ahead_queues_rows_too(tiny_dirs, monkeypatch):
    """A pipelined target (GPU; here DFLASH_PIPELINE=1) queues the next cycle's rows behind the
    verify on the bet that its kept row is accepted whole; the ids stay mlx-lm's."""
    from dflash.engine import target as target_mod
    from dflash.engine.loading import load_pair

    monkeypatch.setenv(target_mod.PIPELINE_ENV, "1")
    pair = load_pair(tiny_dirs["qwen3"], tiny_dirs["qwen3"] / "draft")
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, 2 * N_NEW + 16)
    drafter = _SecondChoiceOracle(ref, len(ids), 16, vocab_size=pair.target.vocab_size)
    pair.tokenizer.eos_token_ids = set()
    final, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, 2 * N_NEW, copy_draft=False,
                          branches=4)
    assert final.token_ids == ref[: 2 * N_NEW]
    assert final.stats.run_ahead > 0 and final.stats.branch_wins > 0


def test_replay_script_reports_tokens_per_cycle_per_row_count(tiny_dirs, tmp_path):
    """scripts/branch_replay.py on a tiny pair: one prompt, every row count reported."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"kind": "chat", "prompt": "Tell me about foxes."}) + "\n")
    out = tmp_path / "replay.json"
    d = tiny_dirs["llama"]
    script = Path(__file__).resolve().parents[1] / "scripts/branch_replay.py"
    subprocess.run([sys.executable, str(script), "--target", str(d), "--draft", str(d / "draft"),
                    "--heldout-file", str(held), "--max-tokens", "12", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["prompts"] == 1 and set(res["tokens_per_cycle"]) == {"1", "2", "4", "8"}
    assert all(v >= 1.0 for v in res["tokens_per_cycle"].values())
    assert all(c >= 1 for c in res["cycles"].values())


def test_stats_line_names_the_rows(pairs):
    from dflash.engine.generate import format_stats

    pair = pairs("qwen3")
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, pair.tokenizer.encode(PROMPT),
                          16, verify_window="full", branches=4)
    line = format_stats(final.stats.to_dict())
    assert (f"4 draft rows on {final.stats.branch_cycles} cycles, {final.stats.branch_wins} kept "
            "a swapped row") in line
    one, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, pair.tokenizer.encode(PROMPT), 8)
    assert "draft rows" not in format_stats(one.stats.to_dict())


def test_stats_line_on_a_cached_prompt_and_on_plain_steps(pairs):
    """A prompt the prefix cache held whole is no 0 tok/s prefill; a run of plain steps only has
    no speedup estimate (it would compare plain decoding with itself)."""
    from dflash.engine.generate import format_stats

    pair = pairs("qwen3")
    plain, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, pair.tokenizer.encode(PROMPT),
                          16, verify_window=1)
    s = plain.stats.to_dict()
    assert s["plain_steps"] == s["cycles"] and s["est_speedup"] > 0  # the estimate is kept in stats
    assert "plain decoding, est." not in format_stats(s)  # but not shown: plain against plain
    assert "plain decoding, est." in format_stats({**s, "plain_steps": s["cycles"] - 1})
    cached = format_stats({**s, "cached_prompt_tokens": s["prompt_tokens"], "prefill_tps": 0.0})
    assert "cached), nothing to prefill |" in cached and "0.0 tok/s |" not in cached


def test_rows_on_a_cuda_gpu_only_where_the_kernel_takes_the_attention(monkeypatch):
    """MLX 0.32's own CUDA attention failed over batched rows (session 15), so on a GPU rows need
    fewq's kernel: bf16/fp16, its head shapes, the kernel chosen; the CPU takes rows either way."""
    from dflash.engine import verifyattn

    smol = (9, 3, 64)  # SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64
    assert branches.attention_takes_rows("fastexp", mx.float32, *smol)  # this CPU
    assert branches.attention_takes_rows("mlx", mx.bfloat16, None, None, None)
    monkeypatch.setattr(verifyattn, "cuda", lambda: True)
    assert branches.attention_takes_rows("kernel", mx.bfloat16, *smol)
    assert branches.attention_takes_rows("kernel", mx.float16, 32, 8, 128)
    assert not branches.attention_takes_rows("kernel", mx.float32, *smol)  # fp32: MLX's attention
    assert not branches.attention_takes_rows("mlx", mx.bfloat16, *smol)  # DFLASH_VERIFY_ATTN=mlx
    assert not branches.attention_takes_rows("kernel", mx.bfloat16, 9, 3, 96)  # a head dim it lacks
    assert not branches.attention_takes_rows("kernel", mx.bfloat16, None, 3, 64)


def test_a_target_whose_rows_attention_is_not_ours_loads_with_one_row(tiny_dirs, monkeypatch):
    from dflash.engine.loading import load_pair

    monkeypatch.setenv(branches.ENV, "4")
    assert load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft").target.branches == 4
    seen = []
    monkeypatch.setattr(branches, "attention_takes_rows", lambda *a: seen.append(a) or False)
    with pytest.warns(RuntimeWarning, match="DFLASH_BRANCHES=4: .* one row per verify"):
        pair = load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft")
    assert pair.target.branches == 1
    attn, dtype, heads, kv, dim = seen[0]
    assert attn == pair.target.verify_attention and dtype == mx.float32
    args = pair.target.args
    assert (heads, kv, dim) == (args.num_attention_heads, args.num_key_value_heads,
                                pair.target.layers[0].self_attn.k_proj.weight.shape[0] // kv)


def test_default_rows_stop_where_their_cache_copies_pass_the_budget(pairs):
    """The default rows (no DFLASH_BRANCHES) verify several rows while R copies of the KV cache
    fit the target's budget, then one; rows asked for run at any length. Ids: mlx-lm's."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, N_NEW + 16)
    drafter = _SecondChoiceOracle(ref, len(ids), 16, vocab_size=pair.target.vocab_size)
    caches = pair.target.make_cache()
    pair.target.model(mx.array([ids]), cache=caches)
    per_token = branches.kv_bytes_per_token(caches)
    args = pair.target.args
    head_dim = args.hidden_size // args.num_attention_heads
    if getattr(args, "head_dim", None):
        head_dim = args.head_dim
    assert per_token == args.num_hidden_layers * 2 * args.num_key_value_heads * head_dim * 4
    saved = pair.target.branches, pair.target.branch_budget, pair.tokenizer.eos_token_ids
    pair.target.branches, pair.target.branch_budget = 4, 4 * (len(ids) + 40) * per_token
    pair.tokenizer.eos_token_ids = set()
    try:
        capped, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW,
                               verify_window="full", copy_draft=False)
        asked, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW,
                              verify_window="full", copy_draft=False, branches=4)
    finally:
        pair.target.branches, pair.target.branch_budget, pair.tokenizer.eos_token_ids = saved
    assert capped.token_ids == asked.token_ids == ref[:N_NEW]
    # rows up to ~40 tokens past the prompt (whole blocks), then row 0 alone (2 tokens a cycle)
    assert 1 <= capped.stats.branch_cycles <= 3
    assert capped.stats.cycles - capped.stats.branch_cycles >= 8
    assert asked.stats.branch_cycles >= asked.stats.cycles - 1


def test_default_rows_fall_back_quietly_where_the_attention_cannot_take_them(tiny_dirs, monkeypatch):
    """Unset DFLASH_BRANCHES on a target whose verify attention cannot take rows (fp32 on a GPU,
    say): one row, no warning; the default's budget is set, an asked-for count has none."""
    import warnings

    from dflash.engine.loading import load_pair

    monkeypatch.delenv(branches.ENV, raising=False)
    monkeypatch.setattr(branches, "default_rows", lambda: 8)
    pair = load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft")
    assert pair.target.branches == 8 and pair.target.branch_budget == branches.DEFAULT_BUDGET_BYTES
    monkeypatch.setattr(branches, "attention_takes_rows", lambda *a: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pair = load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft")
    assert pair.target.branches == 1
    monkeypatch.setenv(branches.ENV, "2")
    monkeypatch.setattr(branches, "attention_takes_rows", lambda *a: True)
    assert load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft").target.branch_budget is None
