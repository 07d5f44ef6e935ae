"""scripts/host_probe.py: build / total times per forward kind and variant, on a tiny pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_probe_times_every_forward_and_its_variants_keep_the_logits(tiny_dirs, tmp_path: Path):
    out = tmp_path / "probe.json"
    d = tiny_dirs["llama"]
    subprocess.run([sys.executable, str(REPO / "scripts/host_probe.py"), "--model", str(d),
                    "--draft", str(d / "draft"), "--repeats", "2", "--rounds", "2", "--rows", "4", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["mlp_compiled_logits_equal"] is True
    assert res["fused_proj_logits_equal"] is True  # one product for q/k/v and gate/up: same logits
    rows = res["rows"]
    for kind in ("step", "verify16", "verify16_eager", "draft15", "mlp_compiled_step",
                 "mlp_compiled_verify16", "mlp_compiled_verify16_eager", "verify16_rows1",
                 "verify16_rows4", "fused_proj_step", "fused_proj_verify16"):
        r = rows[kind]
        assert 0 < r["build_ms"] <= r["total_ms"] and len(r["rounds_total_ms"]) == 2
    assert "fused_proj_draft15" not in rows  # the draft pass is the same in every variant
    for kind in ("loop_ms_per_token", "mlp_compiled_loop_ms_per_token", "fused_proj_loop_ms_per_token"):
        assert rows[kind]["median"] > 0 and len(rows[kind]["rounds"]) == 2
