"""Session 45: a library user's process (not re-executed with MKL as the commands are) is told
once, with the fix, that fp32 on the CPU runs slow; `dflash benchmark --chat` rows are told
apart by question, not by prompt length. Real processes on tiny random-weight models."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dflash.engine import accel

MKL = accel.find_mkl()
needs_mkl = pytest.mark.skipif(sys.platform != "linux" or MKL is None or platform.machine() != "x86_64",
                               reason="MKL not installed in this environment (pip install 'dflash[fastcpu]')")

# Two loads in one process (the warning comes once); the tiny model is under the size the
# warning is meant for, so the threshold is lowered here.
LOAD_TWICE = """
import sys, warnings
warnings.simplefilter("always")
from dflash.engine import accel
from dflash.engine.loading import load_pair
accel.SLOW_BLAS_MIN_PARAMS = 0
for _ in range(2):
    load_pair(sys.argv[1], sys.argv[1] + "/draft", dtype="float32")
print("loaded")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DFLASH_") and k not in ("LD_PRELOAD", "MKL_THREADING_LAYER")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s45-no-config", **extra}


def _load(model: Path, **extra: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", LOAD_TWICE, str(model)], capture_output=True, text=True,
                         timeout=120, env=_env(**extra))
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-3000:]
    return out


@needs_mkl
def test_a_library_process_without_mkl_is_warned_once_with_the_fix(tiny_dirs):
    out = _load(tiny_dirs["llama"])
    assert out.stderr.count("SlowBLASWarning") == 1, out.stderr
    assert f"LD_PRELOAD={MKL}" in out.stderr and "MKL_THREADING_LAYER=" in out.stderr, out.stderr
    assert "maybe_reexec()" in out.stderr and "DFLASH_BLAS=none" in out.stderr


@needs_mkl
def test_no_warning_with_mkl_preloaded_or_the_fast_path_turned_off(tiny_dirs):
    preloaded = _load(tiny_dirs["llama"], LD_PRELOAD=str(MKL), MKL_THREADING_LAYER="SEQUENTIAL")
    assert "SlowBLASWarning" not in preloaded.stderr, preloaded.stderr
    off = _load(tiny_dirs["llama"], DFLASH_BLAS="none")
    assert "SlowBLASWarning" not in off.stderr, off.stderr


def test_the_warning_stays_off_a_gpu_small_models_and_other_dtypes(monkeypatch):
    monkeypatch.setattr(accel, "_WARNED", False)
    monkeypatch.setattr(accel, "_CHOSEN", None)  # an earlier test's maybe_reexec(blas = none)
    monkeypatch.setattr(accel, "mkl_loaded", lambda *a: False)
    monkeypatch.setattr(accel, "fix_prefix", lambda *a, **k: "LD_PRELOAD=x MKL_THREADING_LAYER=INTEL")
    monkeypatch.delenv("DFLASH_BLAS", raising=False)
    big = accel.SLOW_BLAS_MIN_PARAMS
    assert not accel.warn_slow_blas("float32", big, on_cpu=False)
    assert not accel.warn_slow_blas("bfloat16", big, on_cpu=True)
    assert not accel.warn_slow_blas("float32", big - 1, on_cpu=True)
    if sys.platform == "linux":
        with pytest.warns(accel.SlowBLASWarning, match="LD_PRELOAD=x MKL_THREADING_LAYER=INTEL"):
            assert accel.warn_slow_blas("float32", big, on_cpu=True)
        assert not accel.warn_slow_blas("float32", big, on_cpu=True)  # once per process


def test_mkl_loaded_reads_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /venv/lib/libmkl_rt.so.3\n")
    assert accel.mkl_loaded(maps) is True
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert accel.mkl_loaded(maps) is False
    assert accel.mkl_loaded(tmp_path / "none") is None


def test_chat_rows_are_labelled_by_question_not_prompt_length(tiny_dirs, tmp_path):
    """The same question twice: both rows have one prompt length, yet two labels (Q1, Q2); the
    context column stays, and the JSON rows and runs say which question (0-based)."""
    from click.testing import CliRunner

    from dflash.engine.bench.cli import benchmark_command
    from dflash.engine.bench.plot import format_table

    questions = tmp_path / "q.txt"
    questions.write_text("What is two plus two?\nWhat is two plus two?\n")
    res = CliRunner().invoke(benchmark_command, [
        "--model", str(tiny_dirs["llama"]), "--draft", str(tiny_dirs["llama"] / "draft"), "--chat",
        "--prompt-file", str(questions), "--max-tokens", "4", "--repeats", "1", "--cooldown", "0",
        "--verify-iters", "0", "--no-plot", "--out", str(tmp_path / "res")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    (saved,) = (tmp_path / "res").glob("*.json")
    data = json.loads(saved.read_text())
    rows = data["summary"]
    assert len(rows) == 2 and rows[0]["context"] == rows[1]["context"]
    assert [r["question"] for r in rows] == [0, 1]
    assert sorted({(r["question"], r["engine"]) for r in data["runs"]}) == [
        (0, "baseline"), (0, "dflash"), (1, "baseline"), (1, "dflash")]
    table = format_table(data).splitlines()
    assert table[1].split()[:2] == ["question", "context"]
    labels = [line.split()[0] for line in table[3:5]]
    assert labels == ["Q1", "Q2"], table
    # a result written before the field existed is labelled by place
    from dflash.engine.bench.plot import question_labels

    old = [{k: v for k, v in r.items() if k != "question"} for r in rows]
    assert question_labels(old) == ["Q1", "Q2"]
