"""Adversarial hunt on the offline command line, session 47: `dflash train-draft`, `draft-vocab`
and `eval-draft` fed a damaged data cache, a damaged trainer.json, or an --out that is not
theirs. Each test fails on the code before its fix. Real processes on a tiny random-weight
model written by `dflash make-tiny`; no mocks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_cli_s44_bench import _one_error  # one clean failure: exit 1, one Error: line

SHAPE = ["--block-size", "8", "--num-capture", "3", "--seqs-per-batch", "2", "--anchors-per-seq", "4",
         "--max-len", "64", "--eval-prompts", "0", "--dtype", "float32", "--no-compile", "--log-every", "1"]
CAMPAIGN = ["--num-prompts", "5", "--max-new-tokens", "12", "--seed", "3"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s47-no-config", "DFLASH_BLAS": "none"}


def _dflash(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.engine.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=_env())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny target (root/q, its draft in root/q/draft) and a 2-step campaign (root/run)."""
    d = tmp_path_factory.mktemp("s47cli")
    r = _dflash(d, "make-tiny", "q", "--arch", "qwen3")
    assert r.returncode == 0, r.stderr
    r = _dflash(d, "train-draft", "--target", "q", "--out", "run", *SHAPE, *CAMPAIGN,
                "--max-steps", "2", "--total-steps", "10")
    assert r.returncode == 0, r.stderr
    return d


def _damaged_cache(root: Path, tmp_path: Path, response_ids) -> Path:
    """A copy of the campaign's data cache whose first answer's ids are `response_ids`."""
    data = tmp_path / "data"
    shutil.copytree(root / "run" / "data", data)
    f = data / "responses.jsonl"
    lines = f.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["response_ids"] = response_ids
    lines[0] = json.dumps(rec)
    f.write_text("\n".join(lines) + "\n")
    return data


# --- 1. a damaged line of the data cache: one line naming it ------------------------------------
@pytest.mark.parametrize("ids", [[1, None, 3], "abc", [-3, 5, 6, 7], [1.5, 5, 6, 7], [True, 5, 6, 7]],
                         ids=["null", "string", "negative", "fraction", "bool"])
def test_a_damaged_cached_answer_is_refused_naming_its_file_and_line(root: Path, tmp_path: Path, ids):
    """Before: a null or a string in response_ids ended train-draft with a Python traceback
    (TypeError in TokenStore / Sample.ids), and a negative, fractional or boolean id was trained
    on without a word (a draft written from garbage, exit 0)."""
    data = _damaged_cache(root, tmp_path, ids)
    out = tmp_path / "out"
    r = _dflash(root, "train-draft", "--target", "q", "--out", out, "--data-dir", data, *SHAPE,
                *CAMPAIGN, "--max-steps", "2")
    assert _one_error(r) == (f"Error: {data / 'responses.jsonl'}, line 1: not a cached response "
                             "(\"response_ids\" must be a list of token ids (integers >= 0)); delete that "
                             "line or the file to regenerate it"), r.stderr
    assert not (out / "model.safetensors").exists() and not (out / "checkpoint").exists()


def test_draft_vocab_refuses_a_damaged_cache_and_keeps_the_draft_working(root: Path, tmp_path: Path):
    """Before: a null id was a traceback; a negative one was ranked into draft_vocab.json, after
    which `dflash generate` with that draft failed ("'ranked' must be a list of token ids")."""
    draft = tmp_path / "draft"
    shutil.copytree(root / "q" / "draft", draft)
    for ids in ([1, None, 3], [-5, 3, 4]):
        data = _damaged_cache(root, tmp_path / str(len(ids) + (ids[1] is None)), ids)
        r = _dflash(root, "draft-vocab", "--data", data, "--draft", draft, "--size", "10")
        assert "\"response_ids\" must be a list of token ids" in _one_error(r), r.stderr
    assert not (draft / "draft_vocab.json").exists()
    r = _dflash(root, "generate", "--model", "q", "--draft", draft, "-p", "hi", "-m", "3")
    assert r.returncode == 0, r.stderr


def test_a_cache_that_is_not_utf8_is_named(root: Path, tmp_path: Path):
    """Before: "Error: 'utf-8' codec can't decode byte 0xff in position 0" without the file."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "responses.jsonl").write_bytes(b"\xff\xfe{}\n")
    r = _dflash(root, "draft-vocab", "--data", data, "--draft", root / "q" / "draft")
    err = _one_error(r)
    assert str(data / "responses.jsonl") in err and "not UTF-8" in err, err


# --- 2. token ids past the target's vocabulary -------------------------------------------------
def test_cached_ids_past_the_targets_vocabulary_are_refused_not_a_crash(root: Path, tmp_path: Path):
    """Before: the embedding lookup read out of bounds and the process died of SIGSEGV (exit
    139, no word) once training started: another model's answers in --data-dir."""
    data = _damaged_cache(root, tmp_path, [99999, 5, 6, 7, 8])
    r = _dflash(root, "train-draft", "--target", "q", "--out", tmp_path / "out", "--data-dir", data, *SHAPE,
                *CAMPAIGN, "--max-steps", "2")
    err = _one_error(r)
    assert err.startswith(f"Error: {data}: a cached token id (99999) is past the target's vocabulary of "), err
    assert "another model's; use another --data-dir" in err


# --- 3. eval-draft --out: never over a file that is not a report -------------------------------
def test_eval_draft_will_not_replace_a_file_that_is_not_a_report(root: Path, tmp_path: Path):
    """Before: `--out MODEL/config.json` (a slip of the shell) replaced the target's config
    with the report after a note, and the model no longer loaded. An earlier report is still
    replaced (test_tools_s42)."""
    model = tmp_path / "q"
    shutil.copytree(root / "q", model)
    before = (model / "config.json").read_bytes()
    args = ["eval-draft", "--target", model, "--draft", model / "draft", "--prompts", "1", "--max-tokens", "4"]
    r = _dflash(root, *args, "--out", model / "config.json")
    assert _one_error(r) == (f"Error: --out {model / 'config.json'} exists and is not an eval-draft report: "
                             "it would be replaced; name another file (or delete it first)"), r.stderr
    assert (model / "config.json").read_bytes() == before
    rep = tmp_path / "rep.json"
    for _ in range(2):  # a new report, then the same again over it
        r = _dflash(root, *args, "--out", rep)
        assert r.returncode == 0, r.stderr
    assert json.loads(rep.read_text())["prompts"] == 1


# --- 4. a damaged trainer.json: refused before anything is changed -----------------------------
@pytest.mark.parametrize("edit, words", [
    ({"step": -5}, "'step' must be an integer >= 0, got -5"),
    ({"schedule": 3}, "'schedule' must be an object of numbers"),
    ({"schedule": {"lr": "nan", "total_steps": 10}}, "'schedule' must be an object of numbers"),
], ids=["negative-step", "schedule-int", "schedule-string"])
def test_a_damaged_trainer_json_is_refused_and_the_log_kept(root: Path, tmp_path: Path, edit, words):
    """Before: a negative step trimmed train_log.jsonl (its records "past step -5" dropped) and
    then failed ("expected non-negative integer"); a schedule that is not an object of numbers
    was a traceback (AttributeError)."""
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    f = run / "checkpoint" / "trainer.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **edit}))
    log = (run / "train_log.jsonl").read_bytes()
    r = _dflash(root, "train-draft", "--target", "q", "--out", run, "--resume", run / "checkpoint", *SHAPE,
                "--max-steps", "2")
    assert _one_error(r) == f"Error: {f}: {words}", r.stderr
    assert (run / "train_log.jsonl").read_bytes() == log


# --- 5. a draft shape no machine can train: refused before the data, not a dead process -------
@pytest.mark.parametrize("args, words", [
    (["--layers", "100000"], "Error: --layers 100000 is over the target's 4 layers: a draft that deep costs "
                             "more than the target's own pass, so it cannot speed it up"),
    (["--block-size", "100000", "--max-len", "64"],
     "Error: block size 100000 is over --max-len 64: a block longer than a training sequence has nothing "
     "to learn past its end"),
], ids=["layers", "block-size"])
def test_a_huge_draft_shape_is_one_line_not_a_killed_process(root: Path, tmp_path: Path, args, words):
    """Before: --layers 100000 was killed for memory (exit 137, not a word) and --block-size
    100000 died of SIGSEGV (exit 139) in its first step, after the data was generated."""
    shape = [a for a in SHAPE if a not in ("--block-size", "8", "--max-len", "64")]
    out = tmp_path / "out"
    r = _dflash(root, "train-draft", "--target", "q", "--out", out, *shape, "--block-size", "8", "--max-len", "64",
                *args, "--num-prompts", "2", "--max-new-tokens", "4", "--max-steps", "1")
    assert _one_error(r) == words, r.stderr
    assert not out.exists()


def test_make_tiny_refuses_a_draft_deeper_than_its_tiny_target(tmp_path: Path):
    """Before: --draft-layers 100000 ran until the kernel killed it for memory (exit 137, not a
    word); now a usage error before anything is built, and nothing written."""
    r = _dflash(tmp_path, "make-tiny", "t", "--draft-layers", "100000")
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "Invalid value for '--draft-layers': 100000 is not in the range 1<=x<=4." in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
