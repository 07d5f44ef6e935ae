"""scripts/arms_ab.py: engine settings interleaved in one process, same ids, paired ratios."""

from __future__ import annotations

import math
import os

import pytest

from helpers import load_script


def _module():
    return load_script("arms_ab")


def test_arms_parse_and_bad_specs_say_what_is_wrong():
    mod = _module()
    assert mod.parse_arm("cut:cut=2").settings == {"cut": 2}
    assert mod.parse_arm("w:window=full,copy=0").settings == {"window": "full", "copy": False}
    assert mod.parse_arm("w8:window=8").settings == {"window": 8}
    assert mod.parse_arm("plain").settings == {}
    assert mod.parse_arm("new:draft=/x/y,cut=4").settings == {"draft": "/x/y", "cut": 4}
    assert mod.parse_arm("narrow:wide=0").settings == {"wide": False}
    assert mod.parse_arm("m:conf=0,wide=0").settings == {"conf": False, "wide": False}
    assert mod.parse_arm("g:gap=32").settings == {"gap": 32}
    assert mod.parse_arm("old:gap=128,fdecay=0.9").settings == {"gap": 128, "fdecay": 0.9}
    assert mod.parse_arm("s:fast=0").settings == {"fast": False}
    assert mod.parse_arm("r8:rows=8").settings == {"rows": 8}
    for bad, why in (("cut:cut=-1", "integer >= 0"), ("w:window=1", ">= 2"), ("x:rows=0", ">= 1"), ("x:rows=9", "<= 8"), ("x:row=2", "not one of"),
                     (":cut=2", "NAME:KEY"), ("mlx-lm:cut=2", "NAME:KEY"), ("c:copy=2", "<= 1"),
                     ("c:cut", "not one of"), ("d:draft=", "needs a directory"), ("c:conf=3", "<= 1"), ("g:gap=0", ">= 1"), ("f:fast=2", "<= 1"),
                     ("d:fdecay=1", "between 0 and 1"), ("d:fdecay=x", "between 0 and 1")):
        with pytest.raises(ValueError, match=why):
            mod.parse_arm(bad)


def test_every_arm_answers_every_prompt_alike(pairs, monkeypatch):
    monkeypatch.delenv("DFLASH_WINDOW_WIDE", raising=False)
    monkeypatch.delenv("DFLASH_WINDOW_CONFIDENCE", raising=False)
    mod = _module()
    pair = pairs("qwen3")
    before = pair.drafter.short_max
    prompts = [pair.tokenizer.encode(t) for t in ("The quick brown fox jumps", "def add(a, b):")]
    arms = [mod.parse_arm(s) for s in ("whole:cut=0", "cut:cut=3", "w4:window=4,copy=0", "wide:wide=1,conf=0,gap=16")]
    res = mod.run(pair, prompts, arms, rounds=2, max_tokens=24, baseline=True, warmup=1)
    assert pair.drafter.short_max == before  # restored
    assert list(res) == ["mlx-lm", "whole", "cut", "w4", "wide"]
    assert "DFLASH_WINDOW_WIDE" not in os.environ and "DFLASH_WINDOW_CONFIDENCE" not in os.environ  # undone
    assert [r["question"] for r in res["cut"]] == [0, 1, 0, 1]
    assert all(r["tokens"] > 0 and r["decode_tps"] > 0 for arm in res.values() for r in arm)
    assert all(r["same_ids"] for name in ("whole", "cut", "w4", "wide") for r in res[name])
    assert all(r["mean_verify_window"] <= 4 for r in res["w4"])
    table = mod.summary(res)
    assert table["mlx-lm"]["ratio"] == pytest.approx(1.0) and table["mlx-lm"]["tokens_per_cycle"] is None
    for name in ("whole", "cut", "w4", "wide"):
        p = table[name]
        assert p["vs"] == "mlx-lm" and p["n"] == 4 and p["id_diffs"] == 0
        assert p["low"] <= p["ratio"] <= p["high"] and math.isfinite(p["ratio"])
        assert p["tokens_per_cycle"] >= 1


def test_arm_names_must_differ(pairs):
    mod = _module()
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match="must differ"):
        mod.run(pair, [[1, 2, 3]], [mod.parse_arm("a:cut=0"), mod.parse_arm("a:cut=2")], 1, 4)


def test_questions_are_the_chat_five_then_a_fixed_draw_of_held_out_ones():
    mod = _module()
    from dflash.engine.bench.setup import CHAT_QUESTIONS

    qs = mod.questions(7)
    assert qs[:5] == CHAT_QUESTIONS and len(qs) == 12 and set(qs[5:]) <= set(mod.questions(48))
    assert mod.questions(7) == qs


def test_an_arm_can_bring_its_own_draft(pairs, tmp_path):
    """draft=DIR: a second drafter for the same target, loaded once, its own short_max restored."""
    from dflash.engine.draft import save_draft

    mod = _module()
    pair = pairs("qwen3")
    save_draft(pair.drafter.draft, tmp_path / "other")
    arms = [mod.parse_arm(s) for s in ("own:cut=0", f"other:draft={tmp_path / 'other'},cut=2",
                                       f"other-whole:draft={tmp_path / 'other'},cut=0")]
    mod.attach_drafters(pair, arms, None)
    assert arms[0].drafter is None and arms[1].drafter is arms[2].drafter is not pair.drafter
    before = arms[1].drafter.short_max
    res = mod.run(pair, [pair.tokenizer.encode("The quick brown fox")], arms, rounds=1, max_tokens=16)
    assert arms[1].drafter.short_max == before
    assert all(r["same_ids"] for name in ("other", "other-whole") for r in res[name])


def test_a_gap_arm_sets_the_probe_gap_for_its_own_generations_only(pairs, monkeypatch):
    from dflash.engine import generate as generate_mod
    from dflash.engine import window as window_mod

    mod = _module()
    pair = pairs("qwen3")
    gaps = []
    real_init = window_mod.VerifyWindow.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        gaps.append((self.max_probe_gap, self.full_decay))

    monkeypatch.setattr(window_mod.VerifyWindow, "__init__", spy)
    monkeypatch.delenv("DFLASH_WINDOW_WIDE", raising=False)
    ids = pair.tokenizer.encode("The quick brown fox jumps")
    for spec in ("g:gap=16", "plain", "d:fdecay=0.8", "w:wide=1"):
        mod._generate(pair, mod.parse_arm(spec), ids, 8)
    assert gaps == [(16, 0.97), (128, 0.97), (128, 0.8), (16, 0.97)]  # wide windows: gap 16 as shipped
    assert generate_mod.VerifyWindow is window_mod.VerifyWindow


def test_a_mem_arm_hands_its_window_memory_from_generation_to_generation(pairs):
    """mem=1: what one generation's window measured is the arm's next one's prior (the daemon's
    way), in the arm's own WindowMemory; without it every generation starts from the priors."""
    mod = _module()
    pair = pairs("qwen3")
    mem, fresh = mod.parse_arm("m:mem=1"), mod.parse_arm("f:mem=0")
    assert fresh.memory is None and mem.memory is not None and mem.memory.p is None
    ids = pair.tokenizer.encode("The quick brown fox jumps")
    a, _ = mod._generate(pair, mem, ids, 24)
    assert mem.memory.p is not None and mem.memory.d is not None  # measured, handed on
    b, _ = mod._generate(pair, fresh, ids, 24)
    assert a == b  # the output never depends on the window


def test_teach_times_every_arm_on_mlx_lms_text(pairs, monkeypatch):
    """--teach: mlx-lm answers each prompt once, untimed, and every DFlash run decodes that text."""
    from dflash.engine.bench import timing

    mod = _module()
    pair = pairs("qwen3")
    prompts = [pair.tokenizer.encode(t) for t in ("The quick brown fox jumps", "def add(a, b):")]
    taught = []
    real = timing.run_dflash

    def spy(*args, teacher=None, **kwargs):
        taught.append(teacher)
        return real(*args, teacher=teacher, **kwargs)

    monkeypatch.setattr(timing, "run_dflash", spy)
    arms = [mod.parse_arm(s) for s in ("whole:window=full", "auto")]
    res = mod.run(pair, prompts, arms, rounds=1, max_tokens=20, baseline=True, teach=True)
    assert len(taught) == 4 and all(t for t in taught)
    for name in ("whole", "auto"):
        assert all(r["same_ids"] for r in res[name])
    with pytest.raises(ValueError, match="--baseline"):
        mod.run(pair, prompts, arms, rounds=1, max_tokens=4, teach=True)


def test_a_rows_arm_verifies_that_many_rows_for_its_own_generations(tiny_dirs, monkeypatch):
    """rows=N: the pair loads for the most rows asked (DFLASH_BRANCHES restored after), each arm
    verifies its own count, the output is the same; a target that cannot take rows is refused."""
    from dflash.engine import branches

    monkeypatch.delenv("DFLASH_BRANCHES", raising=False)
    mod = _module()
    arms = [mod.parse_arm(s) for s in ("one", "r4:rows=4")]
    pair = mod.load_for_arms(str(tiny_dirs["llama"]), str(tiny_dirs["llama"] / "draft"), None, arms)
    assert "DFLASH_BRANCHES" not in os.environ and pair.target.branches == 1
    assert [a.settings["rows"] for a in arms] == [1, 4]
    prompts = [pair.tokenizer.encode(t) for t in ("The quick brown fox jumps", "def add(a, b):")]
    res = mod.run(pair, prompts, arms, rounds=1, max_tokens=24, baseline=True)
    assert pair.target.branches == 1  # restored
    assert all(r["branch_rows"] == 1 and r["same_ids"] for r in res["one"])
    assert all(r["branch_rows"] == 4 and r["same_ids"] for r in res["r4"])
    monkeypatch.setattr(branches, "attention_takes_rows", lambda *a: False)
    with pytest.raises(ValueError, match="one row only"):
        with pytest.warns(RuntimeWarning):
            mod.load_for_arms(str(tiny_dirs["llama"]), str(tiny_dirs["llama"] / "draft"), None, arms)
