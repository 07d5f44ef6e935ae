"""scripts/rows_cost_probe.py: every timed verify at a first-time cache length, ratios to one row."""

from __future__ import annotations

import argparse

from helpers import load_script


def _module():
    return load_script("rows_cost_probe")


def test_probe_times_each_row_count_at_new_lengths_and_leaves_the_cache_one_row(tiny_dirs, monkeypatch):
    mod = _module()
    grown: list[tuple[int, int]] = []  # (rows, cache length) of every verify
    real = mod.verify

    def spy(target, caches, anchor, drafts, record_tape):
        rows = drafts.shape[0] if drafts.ndim == 2 else 1
        grown.append((rows, caches[0].offset))
        out = real(target, caches, anchor, drafts, record_tape)
        assert caches[0].keys.shape[0] == 1  # the kept row only, whatever was verified
        return out

    monkeypatch.setattr(mod, "verify", spy)
    args = argparse.Namespace(model=str(tiny_dirs["qwen3"]), random_target=None, dtype="float32",
                              lengths="20,40", rows="1,4", warmup=1, repeats=2, parts=True,
                              revisit=True)
    report = mod.probe(args)
    assert [r["cache_length"] for r in report["rows"]] == [20, 40]
    for row in report["rows"]:
        assert set(row["ms"]) == {"1", "4"} and all(v > 0 for v in row["ms"].values())
        assert len(row["all_ms"]["4"]) == 2
        assert row["ratio_to_one_row"]["1"] == 1.0
        assert set(row["revisited_ms"]) == {"1", "4"} and all(v > 0 for v in row["revisited_ms"].values())
        assert set(row["parts_ms"]) == {"4"} and all(v > 0 for v in row["parts_ms"]["4"].values())
        assert row["copies_mib"]["4"] == round(4 * row["cache_length"] * row["kv_bytes_per_token"] / 2**20, 1)
    # per length: 2 row counts x 3 first-time verifies, the cache growing one token a call, then
    # 2 x 3 revisited ones at the length reached (--parts times its verifies outside `verify`)
    assert len(grown) == 24
    for start in (0, 12):
        first, again = grown[start : start + 6], grown[start + 6 : start + 12]
        assert [n for _, n in first] == list(range(first[0][1], first[0][1] + 6))
        assert [r for r, _ in first] == [1, 1, 1, 4, 4, 4]
        assert [n for _, n in again] == [first[-1][1] + 1] * 6
        assert [r for r, _ in again] == [1, 1, 1, 4, 4, 4]
