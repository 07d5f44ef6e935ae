"""`python -m dflash.daemon.bench` (daemon/bench.py, docs/daemon.md): in-process against the
daemon on a tiny pair, with the variants that tell a slower engine from a slower delivery.

Real processes: the benchmark starts real daemons (supervisor, worker, cache process) on real
sockets. Nothing here asserts on time: the JSON's shape, that every variant ran every prompt,
and that each run carries the engine's own clock beside the caller's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dflash.daemon import bench


def test_daemon_bench_variants(tiny_dirs, tmp_path: Path) -> None:
    target = tiny_dirs["llama"]
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [sys.executable, "-m", "dflash.daemon.bench", "--model", str(target), "--draft",
         str(target / "draft"), "--out", str(out), "--max-tokens", "8", "--repeats", "1",
         "--variants", "inproc,thread,daemon-nocache,inproc", "--blas", "none"],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    # the asked-for variants in order (a name given twice runs twice), then daemon, always run
    assert [(p["variant"], p["pass"]) for p in data["passes"]] == [
        ("inproc", 1), ("thread", 1), ("daemon-nocache", 1), ("inproc", 2), ("daemon", 1)]
    assert list(data["variants"]) == ["inproc", "thread", "daemon-nocache", "daemon"]
    for p in data["passes"]:
        assert p["runs"] == len(bench.PROMPTS)  # one repeat of every prompt (warm-up dropped)
    for name, runs in data["runs"].items():
        passes = data["variants"][name]["passes"]
        assert passes == (2 if name == "inproc" else 1)
        assert len(runs) == passes * len(bench.PROMPTS) == data["variants"][name]["runs"], name
        assert sorted({r["pass"] for r in runs}) == list(range(1, passes + 1))
        for run in runs:
            assert run["tokens"] >= 1 and run["engine_decode_tps"] is not None
            assert run["tokens_per_cycle"] >= 1.0
    assert data["in_process"] == data["variants"]["inproc"] and data["daemon"] == data["variants"]["daemon"]
    assert data["decode_tps_ratio"] > 0


def test_daemon_bench_refuses_an_unknown_variant(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "dflash.daemon.bench", "--model", "m", "--out", str(tmp_path / "x.json"),
         "--variants", "inproc,gpu-magic"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown variant(s) gpu-magic" in res.stderr
    assert not (tmp_path / "x.json").exists()
