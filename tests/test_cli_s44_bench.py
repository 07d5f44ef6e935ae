"""`dflash benchmark` under a demanding user's input (session 44): a draft made for another
target, a `--process-per-run` child that fails, a result or a plot that cannot be written (a
full disk), an empty --out. Each is one line on stderr and a sane exit status, never a
traceback, and leaves no torn file. Real processes on tiny random-weight models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dflash.engine import tiny

QUICK = ["--contexts", "48", "--max-tokens", "6", "--repeats", "1", "--warmup", "0", "--cooldown", "0",
         "--verify-iters", "0"]


def _env() -> dict[str, str]:
    """This environment without a user's dflash settings; no BLAS re-exec (quicker, same paths)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s44-no-config", "DFLASH_BLAS": "none"}


def _bench(cwd: Path, *args: str, limit_kib: int | None = None) -> subprocess.CompletedProcess:
    return _dflash(cwd, "benchmark", *args, limit_kib=limit_kib)


def _dflash(cwd: Path, *args: str, limit_kib: int | None = None) -> subprocess.CompletedProcess:
    """`dflash ARGS` in `cwd`; `limit_kib`: files it writes are cut at that size, as on a full
    disk (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    cmd = [sys.executable, "-m", "dflash.engine.cli", *args]
    if limit_kib is not None:
        cmd = ["bash", "-c", f"ulimit -f {limit_kib}; exec \"$@\"", "bash", *cmd]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=_env())


def _one_error(out: subprocess.CompletedProcess, code: int = 1) -> str:
    assert out.returncode == code, (out.returncode, out.stdout[-1500:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A draft made for a target of another hidden size (the same 4 layers: its capture layer
    ids fit any tiny target, only check_fit tells them apart)."""
    d = tmp_path_factory.mktemp("wide") / "wide"
    tiny.build_target(d, "qwen3", hidden_size=128, intermediate_size=256)
    tiny.build_draft(d / "draft", d, num_layers=1)
    return d / "draft"


def test_a_draft_for_another_target_is_refused_before_any_run(tiny_dirs, wide, tmp_path):
    """Before: refused only when the first DFlash run started, after the baseline's warm-up and
    timed run (minutes at the default contexts); the docs say before the first run."""
    out = _bench(tmp_path, "--model", str(tiny_dirs["qwen3"]), "--draft", str(wide), *QUICK, "--out", "res")
    assert "draft does not fit the target: hidden size 128 != target's 64" in _one_error(out)
    assert "baseline" not in out.stdout and "repeat" not in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_failed_process_per_run_child_is_one_line(tiny_dirs, wide, tmp_path):
    """Before: the child's whole ValueError traceback, then "the benchmark process for r0-q0
    exited with status 1", which did not say why."""
    (tmp_path / "q.txt").write_text("Hello there\n")
    chat = ["--chat", "--process-per-run", "--prompt-file", "q.txt", *QUICK, "--out", "res"]
    out = _bench(tmp_path, "--model", str(tiny_dirs["qwen3"]), "--draft", str(wide), *chat)
    line = _one_error(out)
    assert line.endswith("the benchmark process for r0-q0 exited with status 1: draft does not fit the "
                         "target: hidden size 128 != target's 64"), line
    out = _bench(tmp_path, "--model", str(tmp_path / "nope"), *chat)
    assert f"exited with status 1: model directory not found: {tmp_path / 'nope'}" in _one_error(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.txt"]


def test_a_result_that_cannot_be_written_is_one_line_and_leaves_no_torn_file(tiny_dirs, tmp_path):
    """Before: an OSError traceback, a JSON cut at the disk's end left as a result, and the table
    never printed (it came after the write): every measurement lost."""
    pair = tiny_dirs["qwen3"]
    (tmp_path / "res").mkdir()
    out = _bench(tmp_path, "--model", str(pair), "--draft", str(pair / "draft"), *QUICK, "--no-plot",
                 "--out", "res", limit_kib=4)
    assert "the result could not be written to res" in _one_error(out)
    assert "dflash tok/s" in out.stdout  # the table is on the screen all the same
    assert list((tmp_path / "res").iterdir()) == []


def test_a_plot_that_cannot_be_written_leaves_the_result_and_no_empty_png(tiny_dirs, tmp_path):
    """Before: the JSON was written, then savefig's OSError was a traceback, exit 1, and an empty
    PNG stayed beside the result."""
    pytest.importorskip("matplotlib")
    pair = tiny_dirs["qwen3"]
    out = _bench(tmp_path, "--model", str(pair), "--draft", str(pair / "draft"), *QUICK, "--out", "res",
                 limit_kib=16)
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.stdout[-1500:], out.stderr[-3000:])
    assert "== plot: not drawn:" in out.stdout, out.stdout
    files = list((tmp_path / "res").iterdir())
    assert [p.suffix for p in files] == [".json"], files
    assert json.loads(files[0].read_text())["summary"]


def test_an_empty_out_is_a_usage_error(tiny_dirs, tmp_path):
    """Before: --out "" (an unset variable) wrote the result into the current directory."""
    pair = tiny_dirs["qwen3"]
    out = _bench(tmp_path, "--model", str(pair), "--draft", str(pair / "draft"), *QUICK, "--out", "")
    assert "Invalid value for '--out'" in _one_error(out, 2)
    assert list(tmp_path.iterdir()) == []
