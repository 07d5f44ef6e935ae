"""scripts/cut_block_ab.py: whole against cut draft blocks, interleaved, same ids."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/cut_block_ab.py"


def _module():
    spec = importlib.util.spec_from_file_location("cut_block_ab", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_both_arms_answer_every_prompt_alike(pairs):
    mod = _module()
    pair = pairs("qwen3")
    before = pair.drafter.short_max
    prompts = [pair.tokenizer.encode(t) for t in ("The quick brown fox jumps", "def add(a, b):")]
    res = mod.run(pair, prompts, cut=3, rounds=2, max_tokens=24)
    assert pair.drafter.short_max == before  # restored
    assert [r["question"] for r in res["cut"]] == [0, 1, 0, 1]
    assert all(r["tokens"] > 0 and r["decode_tps"] > 0 for arm in res.values() for r in arm)
    p = mod.paired(res)
    assert p["n"] == 4 and p["low"] <= p["ratio"] <= p["high"] and math.isfinite(p["ratio"])


def test_questions_are_the_chat_five_then_a_fixed_draw_of_held_out_ones():
    mod = _module()
    from dflash.engine.benchsetup import CHAT_QUESTIONS

    qs = mod.questions(7)
    assert qs[:5] == CHAT_QUESTIONS and len(qs) == 12 and set(qs[5:]) <= set(mod.questions(48))
    assert mod.questions(7) == qs
