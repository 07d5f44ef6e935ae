"""The draft's proposal vocabulary (engine/draftvocab.py): the ranking file, the size rule, the
restricted head, and that output stays the target's (greedy ids, sampled distribution)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash.engine import draftvocab
from dflash.engine.drafters import DFlashDrafter
from dflash.engine.sampling import SamplingParams
from conftest import ARCHS
from helpers import cut_at_eos, greedy_reference, run_dflash
from test_sampling_dist import RUNS_RANDOM_DRAFT, _setup, assert_same_distribution, engine_counts, engine_exact


def _subset(vocab: int, every: int = 3) -> list[int]:
    return list(range(0, vocab, every))


def test_rank_by_frequency_then_id():
    ranked, total = draftvocab.rank([[5, 3, 5], [3, 9, 5], [7]])
    assert ranked == [5, 3, 7, 9] and total == 7


def test_file_round_trip_and_size_rule(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(draftvocab.ENV, raising=False)
    assert draftvocab.choose(tmp_path, 100) is None  # no file: the whole vocabulary
    draftvocab.write(tmp_path, [9, 4, 120, 7, 1], 3, "test", 42)
    body = draftvocab.read(tmp_path)
    assert body["ranked"] == [9, 4, 120, 7, 1] and body["tokens_counted"] == 42
    assert draftvocab.choose(tmp_path, 100) == [4, 7, 9]  # the file's default on the CPU, sorted
    monkeypatch.setenv(draftvocab.ENV, "4")
    assert draftvocab.choose(tmp_path, 100) == [1, 4, 7, 9]  # id 120 is outside a 100-token vocab
    for off in ("0", "full", "FULL"):
        monkeypatch.setenv(draftvocab.ENV, off)
        assert draftvocab.choose(tmp_path, 100) is None
    monkeypatch.setenv(draftvocab.ENV, "100")
    assert draftvocab.choose(tmp_path, 100) is None  # as big as the vocabulary: no restriction
    for bad in ("-3", "lots"):
        monkeypatch.setenv(draftvocab.ENV, bad)
        with pytest.raises(ValueError, match="DFLASH_DRAFT_VOCAB must be"):
            draftvocab.choose(tmp_path, 100)
    monkeypatch.setenv(draftvocab.ENV, "4")
    with pytest.raises(ValueError, match="has no draft_vocab.json"):
        draftvocab.choose(tmp_path / "elsewhere", 100)


@pytest.mark.parametrize("body, match", [
    ("not json", "not a draft vocabulary file"),
    (json.dumps({"ranked": [1, 2]}), "not a draft vocabulary file"),
    (json.dumps({"ranked": [1, 1], "default_size": 1}), "repeats"),
    (json.dumps({"ranked": [1, -2], "default_size": 1}), "list of token ids"),
    (json.dumps({"ranked": [1, 2], "default_size": -1}), "integer >= 0"),
])
def test_bad_files_are_refused(tmp_path: Path, body: str, match: str):
    (tmp_path / draftvocab.FILE).write_text(body)
    with pytest.raises(ValueError, match=match):
        draftvocab.read(tmp_path)


def test_write_refuses_an_empty_ranking(tmp_path: Path):
    with pytest.raises(ValueError, match="no tokens"):
        draftvocab.write(tmp_path, [], 10, "test", 0)


@pytest.mark.parametrize("quantized", [False, True])
def test_subset_head_is_the_target_head_at_its_ids(pairs, quantized):
    """Subset logits are the full head's columns at the ids; full() puts them back, -inf elsewhere;
    a quantized head (its kept rows dequantized once) gives the same logits up to rounding."""

    from dflash.engine.target import TargetModel

    pair = pairs("qwen3")
    target = pair.target
    if quantized:
        from mlx_lm import load

        model, _ = load(pair.model_path)
        nn.quantize(model, group_size=32, bits=8)
        target = TargetModel(model, pair.target.layer_ids)
    ids = _subset(target.vocab_size)
    head = draftvocab.SubsetHead(target, ids)
    h = mx.random.normal((1, 5, target.hidden_size), key=mx.random.key(0))
    full = target.lm_head(h)[0]
    sub = head(h)[0]
    assert sub.shape == (5, len(ids))
    np.testing.assert_allclose(np.array(sub), np.array(full[:, mx.array(ids)]), rtol=1e-4, atol=1e-4)
    back = np.array(head.full(sub))
    assert np.isneginf(np.delete(back, ids, axis=1)).all()
    np.testing.assert_array_equal(back[:, ids], np.array(sub))


def test_drafter_proposes_the_argmax_inside_its_vocabulary(pairs):
    """A drafter over every id proposes what the unrestricted one does; over a subset, the
    subset's argmax of the same logits."""
    pair = pairs("llama")
    ids = pair.tokenizer.encode(PROMPT_TEXT)
    draft = pair.drafter.draft
    whole = DFlashDrafter(draft, pair.target, list(range(pair.target.vocab_size)))
    part = DFlashDrafter(draft, pair.target, _subset(pair.target.vocab_size))
    assert part.proposal_vocab == len(_subset(pair.target.vocab_size)) and pair.drafter.proposal_vocab is None
    logits, feats = pair.target.forward(mx.array(ids)[None], pair.target.make_cache())
    anchor = mx.argmax(logits[0, -1])
    got = {}
    for name, d in (("plain", pair.drafter), ("whole", whole), ("part", part)):
        d.reset()
        d.add_context(feats)
        got[name] = d.propose(anchor, len(ids)).tolist()
    assert got["whole"] == got["plain"]
    assert all(t % 3 == 0 for t in got["part"])
    # the subset argmax, from the drafter's own hidden states
    part.reset()
    part.add_context(feats)
    block = mx.concatenate([anchor.reshape(1).astype(mx.int32), part._masks])[None]
    h = draft(pair.target.embed(block), len(ids), part.cache)[:, 1:]
    full = pair.target.lm_head(h)[0]
    sub = mx.array(_subset(pair.target.vocab_size))
    assert got["part"] == sub[mx.argmax(full[:, sub], axis=-1)].tolist()


PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ids_unchanged_with_a_small_draft_vocabulary(pairs, arch):
    """Lossless per family: a draft limited to a third of the ids still yields mlx-lm's greedy ids."""
    pair = pairs(arch)
    drafter = DFlashDrafter(pair.drafter.draft, pair.target, _subset(pair.target.vocab_size))
    eos = set(pair.tokenizer.eos_token_ids)
    ids = pair.tokenizer.encode(PROMPT_TEXT * 2)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 48), eos)
    final, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, 48, verify_window="full")
    assert final.token_ids == ref


def test_sampling_exact_with_a_small_draft_vocabulary(pairs):
    """Temperature 1: the draft's q is zero outside its subset, so tokens it never proposes come
    only from residual draws; the first NEW tokens still follow the target's distribution."""
    params = SamplingParams(temperature=1.0)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    drafter = DFlashDrafter(pair.drafter.draft, pair.target, _subset(pair.target.vocab_size, 2))
    n = RUNS_RANDOM_DRAFT["qwen3"]
    counts = engine_counts(pair, sharp, lambda: drafter, ids, params, n)
    print(assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


def test_pair_and_benchmark_setup_take_the_draft_s_file(tiny_dirs, tmp_path: Path, monkeypatch):
    """load_pair and the benchmark's setup read draft_vocab.json; the env var overrides it."""
    import shutil

    from dflash.engine.bench.setup import BenchConfig, build_setup
    from dflash.engine.loading import load_pair

    monkeypatch.delenv(draftvocab.ENV, raising=False)
    d = tmp_path / "draft"
    shutil.copytree(tiny_dirs["qwen3"] / "draft", d)
    draftvocab.write(d, list(range(40, 0, -1)), 16, "test", 40)
    pair = load_pair(tiny_dirs["qwen3"], d)
    assert pair.drafter.proposal_vocab == 16
    setup = build_setup(BenchConfig(model=str(tiny_dirs["qwen3"]), draft=str(d)))
    assert setup.draft_vocab == list(range(25, 41))
    from dflash.daemon.worker import _pair_notes

    assert _pair_notes(pair).endswith("; draft proposes its 16 most frequent tokens")  # dflashd status
    monkeypatch.setenv(draftvocab.ENV, "full")
    assert load_pair(tiny_dirs["qwen3"], d).drafter.proposal_vocab is None


def test_draft_vocab_command_ranks_a_data_cache(tiny_dirs, tmp_path: Path):
    """`dflash draft-vocab`: answers of the chosen kind ranked into DRAFT/draft_vocab.json; a
    missing draft or an empty cache is a clear error, not a traceback."""
    import shutil

    from click.testing import CliRunner

    from dflash.engine.cli import main

    data = tmp_path / "data"
    data.mkdir()
    rows = [dict(kind="k", prompt="a", prompt_ids=[1, 2], response_ids=[7, 7, 5]),
            dict(kind="k", prompt="b", prompt_ids=[1], response_ids=[5, 9, 7], temperature=0.7),
            dict(kind="k", prompt="c", prompt_ids=[1], response_ids=[3], split="heldout")]
    (data / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = tmp_path / "draft"
    shutil.copytree(tiny_dirs["qwen3"] / "draft", d)
    run = CliRunner().invoke
    res = run(main, ["draft-vocab", "--data", str(data), "--draft", str(d), "--size", "2"])
    assert res.exit_code == 0, res.output
    body = draftvocab.read(d)
    assert body["ranked"] == [7, 5, 9] and body["default_size"] == 2 and body["tokens_counted"] == 6
    res = run(main, ["draft-vocab", "--data", str(data), "--draft", str(d), "--responses", "greedy"])
    assert res.exit_code == 0 and draftvocab.read(d)["ranked"] == [7, 5]
    res = run(main, ["draft-vocab", "--data", str(data), "--draft", str(tmp_path / "none")])
    assert res.exit_code != 0 and "no draft in" in res.output
    res = run(main, ["draft-vocab", "--data", str(tmp_path / "empty"), "--draft", str(d)])
    assert res.exit_code != 0 and "no responses" in res.output
