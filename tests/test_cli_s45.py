"""Session 45 hardening: a bad --prompt-file line names the file, a prompt's "kind" must be a
string, `dflash benchmark --contexts` past the target's context is refused before anything
loads, and a client time setting past a day is refused (ZeroMQ's poll could not take it).
Each is one clear line, never a traceback; real processes on tiny random-weight models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.client.aio import AsyncDFlashClient
from dflash.client.client import DFlashClient
from dflash.engine.bench.setup import BenchConfig, check_contexts
from dflash.engine.generate import config_context_tokens
from dflash.engine.prompting import prompt_lines
from dflash.engine.training.data import load_prompt_file
from test_cli_s44_bench import QUICK, _bench, _env, _one_error


# --- 1. a bad --prompt-file line names the file ------------------------------------------------
def test_a_bad_benchmark_prompt_file_line_names_the_file(tmp_path: Path):
    """Before: "Error: prompt file line 2: ..." without the file (eval-draft and the training
    readers named it)."""
    held = tmp_path / "h.jsonl"
    held.write_text('{"prompt": "Hello there", "kind": "chat"}\n[1, 2]\n')
    out = _bench(tmp_path, "--model", str(tmp_path / "no_model"), "--chat", "--prompt-file", str(held),
                 "--out", "res")
    assert _one_error(out) == (f"Error: --prompt-file {held}: prompt file line 2: a JSON array, not a "
                               "prompt (a JSON line is an object with a \"prompt\")"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.jsonl"]


# --- 2. a prompt's "kind" is a string ----------------------------------------------------------
@pytest.mark.parametrize("kind", [5, 1.5, True, None, "", "  ", ["chat"], {"a": 1}])
def test_a_prompt_kind_that_is_no_string_is_refused_with_its_line(kind, tmp_path: Path):
    """Before: {"prompt": "hi", "kind": 5} read as kind "5" (a list as "['chat']"), grouping
    held-out results under a made-up name."""
    text = '{"prompt": "One?", "kind": "chat"}\n' + json.dumps({"prompt": "hi", "kind": kind}) + "\n"
    with pytest.raises(ValueError, match='prompt file line 2: "kind" must be a non-empty string, got '):
        prompt_lines(text)
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(ValueError, match=f'{f}: prompt file line 2: "kind" must be'):
        load_prompt_file(f)


def test_a_prompt_kind_that_is_a_string_or_absent_still_reads():
    text = '{"prompt": "One?", "kind": "chat"}\n{"prompt": "Two?"}\nThree?\n'
    assert prompt_lines(text) == [("chat", "One?"), ("file", "Two?"), ("file", "Three?")]


# --- 3. --contexts past the target's context ---------------------------------------------------
def test_contexts_past_a_random_targets_context_are_refused_before_any_run(tmp_path: Path):
    """Before: --contexts 10000000 was taken (the tiny shape declares 4096 positions) and the
    runs started on it; now one line before anything is built, and no results folder."""
    quick = [a for a in QUICK if a not in ("--contexts", "48", "--max-tokens", "6")]
    out = _bench(tmp_path, "--random-target", "tiny", "--contexts", "48,4091", "--max-tokens", "6",
                 *quick, "--out", "res")
    assert _one_error(out) == ("Error: --contexts 4091 + --max-tokens 6 = 4097 tokens is past "
                               "--random-target tiny's context of 4096 tokens: give shorter --contexts "
                               "or fewer --max-tokens"), out.stderr
    assert "baseline" not in out.stdout and "==" not in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == []


def test_contexts_past_a_models_context_are_refused_before_the_weights_load(tiny_dirs, tmp_path: Path):
    """Read from config.json: a folder without weights is refused for its context, not for the
    weights it lacks (which a load would find first)."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_dirs["qwen3"] / "config.json").read_text())
    out = _bench(tmp_path, "--model", str(folder), "--oracle", "--contexts", "10000000", *QUICK[2:],
                 "--out", "res")
    assert _one_error(out) == (f"Error: --contexts 10000000 + --max-tokens 6 = 10000006 tokens is past "
                               f"model {folder}'s context of 4096 tokens: give shorter --contexts or "
                               "fewer --max-tokens"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_what_the_context_check_lets_through(tmp_path: Path):
    """A context that fits, --chat (contexts unused), a config declaring no context, and RoPE
    scaling that extends the declared one are not refused; --warmup-context is a length too."""
    check_contexts(BenchConfig(random_target="tiny", contexts=[4090], max_tokens=6))
    check_contexts(BenchConfig(random_target="tiny", contexts=[10**7], chat=True))
    with pytest.raises(ValueError, match="--warmup-context 5000 "):
        check_contexts(BenchConfig(random_target="tiny", chat=True, warmup_context=5000))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    check_contexts(BenchConfig(model=str(folder), oracle=True, contexts=[10**7]))
    assert config_context_tokens({"max_position_embeddings": 32768,
                                  "rope_scaling": {"type": "yarn", "factor": 4.0}}) == 131072
    assert config_context_tokens({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert config_context_tokens({"max_position_embeddings": "long"}) == 0


# --- 4. client time settings past a day --------------------------------------------------------
@pytest.mark.parametrize("setting", ["timeout", "heartbeat_timeout", "retry_interval"])
@pytest.mark.parametrize("client", [DFlashClient, AsyncDFlashClient])
def test_a_client_time_setting_past_a_day_is_refused(client, setting):
    """Before: 1e300 was taken (ZeroMQ's poll takes int milliseconds, monotonic() + 1e300 never
    moves) and 10**400 raised OverflowError from math.isfinite."""
    for value in (1e300, 86400.5, 10**400):
        with pytest.raises(ValueError, match=f"^{setting} must be at most 86400 seconds \\(one day\\), got "):
            client("ipc:///nonexistent/dflash-s45.sock", **{setting: value})
    c = client("ipc:///nonexistent/dflash-s45.sock", **{setting: 86400})
    assert getattr(c, setting) == 86400.0


def test_client_cli_timeout_past_a_day_is_a_usage_error(tmp_path: Path):
    """Before: --timeout 1e300 was taken and the client waited "forever" for no worker; the
    maximum is stated in --help."""
    cmd = [sys.executable, "-m", "dflash.client.cli", "--endpoint", f"ipc://{tmp_path}/none.sock"]
    help_text = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60, env=_env())
    assert "at most 86400: one day" in " ".join(help_text.stdout.split()), help_text.stdout
    for value in ("1e300", "86401", "1e400"):
        out = subprocess.run([*cmd, "--timeout", value, "status"], capture_output=True, text=True,
                             timeout=60, env=_env())
        assert out.returncode == 2 and not out.stdout, (out.returncode, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert "Invalid value for '--timeout'" in out.stderr and "0<x<=86400" in out.stderr, out.stderr
