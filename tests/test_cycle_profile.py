"""scripts/cycle_profile.py: the loop's host phases timed in place, the loop itself unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/cycle_profile.py"


def test_the_profile_times_every_cycle_once_and_accounts_for_its_time(tiny_dirs, tmp_path: Path):
    d = tiny_dirs["qwen3"]
    out = tmp_path / "cp.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(d), "--draft", str(d / "draft"),
                        "--heldout", "1", "--max-tokens", "24", "--window", "full", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    cycles, ph = res["totals"]["cycles"], res["phases"]
    n_prompts = len(res["per_prompt"])
    assert n_prompts == 6 and cycles >= n_prompts
    assert ph["wait (summary read)"]["calls"] == cycles  # one host read a cycle, each timed
    # every cycle's verify was built and timed (plus at most one queued and undone per answer)
    built = sum(v["calls"] for k, v in ph.items() if k.startswith("verify build"))
    assert cycles <= built <= cycles + n_prompts
    assert ph["verify build (draft cycle)"]["calls"] >= 1  # a full window drafts every cycle
    assert ph["draft build (propose)"]["calls"] >= 1
    accounted = sum(v["ms_total"] for v in ph.values())
    assert 0 < accounted <= res["decode_s"] * 1e3 + 1.0
    assert res["plain_step_ms_mlx_lm"] > 0 and res["steps_per_cycle"] > 0
    assert "wait (summary read)" in r.stdout and "steps" in r.stdout


def test_raw_text_prompts_of_the_lengths_asked(tiny_dirs, tmp_path: Path):
    d = tiny_dirs["qwen3"]
    out = tmp_path / "cp.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(d), "--draft", str(d / "draft"),
                        "--contexts", "40,70", "--max-tokens", "12", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [p["prompt_tokens"] for p in res["per_prompt"]] == [40, 70]
    assert res["prompts"].startswith("raw text") and res["totals"]["cycles"] >= 2
    bad = subprocess.run([sys.executable, str(SCRIPT), "--model", str(d), "--contexts", "a,b"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--contexts 'a,b'" in bad.stderr
