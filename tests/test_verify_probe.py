"""scripts/verify_cost_probe.py: one layer's verify parts and the whole layer; its three attention
paths agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_probe_runs_and_attention_variants_agree(tmp_path: Path):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, str(REPO / "scripts/verify_cost_probe.py"), "--contexts", "64,200",
                    "--tokens", "1,8", "--hidden", "128", "--intermediate", "256", "--heads", "4",
                    "--kv-heads", "2", "--head-dim", "32", "--dtype", "float32", "--repeats", "2",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    res = json.loads(out.read_text())
    rows = {(r["context"], r["tokens"]): r for r in res["rows"]}
    assert set(rows) == {(64, 1), (64, 8), (200, 1), (200, 8)}
    for (_, m), r in rows.items():
        assert r["matmuls_ms"] > 0 and r["sdpa_causal_ms"] > 0 and r["layer_ms"] > 0
        assert "layer_fewq_ms" not in r  # the kernel rows need a CUDA GPU
        assert m == 1 or (r["variants_agree"] and r["sdpa_single_queries_ms"] > 0)
