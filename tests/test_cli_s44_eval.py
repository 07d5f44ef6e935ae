"""`dflash eval-draft`, `dflash draft-vocab` and prompt files under a demanding user's input
(session 44): a missing --heldout-file, an empty --out, a target folder given as --draft, a
draft_vocab.json that cannot be written (a full disk), a JSON line that is no prompt. Each is
one line on stderr and a sane exit status, said before any model loads, never a traceback, and
leaves no file behind. Real processes on tiny random-weight models."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash.engine import tiny
from dflash.engine.prompting import prompt_lines
from test_cli_s44_bench import _dflash
from test_cli_s44_bench import _one_error as one_error


def _one_error(out: subprocess.CompletedProcess, code: int = 1) -> str:
    line = one_error(out, code)
    assert "[Errno" not in line, line
    return line


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """A tiny qwen3 target with its 1-layer random draft in <dir>/draft."""
    d = tmp_path_factory.mktemp("s44eval") / "target"
    tiny.build_target(d, "qwen3")
    tiny.build_draft(d / "draft", d)
    return d


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A training data cache of two cached answers (what train-draft writes)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [dict(kind="k", prompt="a", prompt_ids=[1, 2], response_ids=[7, 7, 5]),
            dict(kind="k", prompt="b", prompt_ids=[1], response_ids=[5, 9, 7])]
    (data / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _eval(cwd: Path, target: Path, held: str, *more: str) -> subprocess.CompletedProcess:
    return _dflash(cwd, "eval-draft", "--target", str(target), "--draft", str(target / "draft"),
                   "--heldout-file", held, "--max-tokens", "2", *more)


# --- eval-draft --------------------------------------------------------------------------------
def test_a_missing_heldout_file_is_a_usage_error_before_any_load(tmp_path: Path):
    """Before: "Error: [Errno 2] No such file or directory: 'nope.jsonl'", exit 1, and only
    after the target had loaded (here a missing target was said first)."""
    line = _one_error(_eval(tmp_path, tmp_path / "no_model", "nope.jsonl", "--out", "r.json"), 2)
    assert "Invalid value for '--heldout-file'" in line and "'nope.jsonl' does not exist" in line, line
    (tmp_path / "held").mkdir()
    line = _one_error(_eval(tmp_path, tmp_path / "no_model", "held"), 2)
    assert "Invalid value for '--heldout-file'" in line and "is a directory" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held"]


def test_an_empty_out_is_a_usage_error(pair: Path, tmp_path: Path):
    """Before: --out "" (an unset variable) evaluated every prompt and wrote no report, exit 0.
    The same check as `dflash benchmark --out ""` (engine/bench/cli.py nonempty_option)."""
    (tmp_path / "h.jsonl").write_text('{"prompt": "Hello there", "kind": "chat"}\n')
    for empty in ("", "  "):
        line = _one_error(_eval(tmp_path, pair, "h.jsonl", "--out", empty), 2)
        assert "Invalid value for '--out': must name the report file, not be empty" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.jsonl"]


# --- draft-vocab -------------------------------------------------------------------------------
def test_draft_vocab_refuses_a_folder_that_is_not_a_draft(pair: Path, cache: Path, tmp_path: Path):
    """Before: a target model's folder (it has a config.json too) was taken as the draft and
    draft_vocab.json written into it, exit 0."""
    target = tmp_path / "target"
    shutil.copytree(pair, target, ignore=shutil.ignore_patterns("draft"))
    before = sorted(p.name for p in target.iterdir())
    line = _one_error(_dflash(tmp_path, "draft-vocab", "--data", str(cache), "--draft", str(target)))
    assert line == f"Error: {target}: not a DFlash draft: its config.json has no dflash_config", line
    assert sorted(p.name for p in target.iterdir()) == before
    # said before the cache is read: an empty cache is not what it complains about
    line = _one_error(_dflash(tmp_path, "draft-vocab", "--data", str(tmp_path / "none"), "--draft", str(target)))
    assert "not a DFlash draft" in line, line
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    line = _one_error(_dflash(tmp_path, "draft-vocab", "--data", str(cache), "--draft", str(tmp_path / "bad")))
    assert f"{tmp_path / 'bad' / 'config.json'} is not readable JSON" in line, line
    out = _dflash(tmp_path, "draft-vocab", "--data", str(cache), "--draft", str(pair / "draft"))
    assert out.returncode == 0, out.stderr  # a real draft still takes it
    (pair / "draft" / "draft_vocab.json").unlink()


def test_draft_vocab_that_cannot_be_written_is_one_line_and_leaves_no_torn_file(pair: Path, cache: Path,
                                                                              tmp_path: Path):
    """Before: an OSError traceback ("OSError: [Errno 27] File too large"): only ValueError was
    caught. The earlier draft_vocab.json is kept as it was, and no draft_vocab.tmp is left."""
    draft = tmp_path / "draft"
    shutil.copytree(pair / "draft", draft)
    (draft / "draft_vocab.json").write_text("earlier\n")
    before = sorted(p.name for p in draft.iterdir())
    out = _dflash(tmp_path, "draft-vocab", "--data", str(cache), "--draft", str(draft), limit_kib=0)
    line = _one_error(out)
    assert line == f"Error: cannot write {draft / 'draft_vocab.json'}: File too large", line
    assert sorted(p.name for p in draft.iterdir()) == before
    assert (draft / "draft_vocab.json").read_text() == "earlier\n"


# --- prompt files ------------------------------------------------------------------------------
def test_a_json_line_that_is_no_prompt_is_refused_with_its_line():
    """Before: `[1,2]`, `5`, `"text"` or `null` in a JSONL file, and {"prompt": 5} or
    {"prompt": null}, were asked as the question text "[1, 2]", "5", ..., "None". Plain-text
    files (one prompt per line, as written) and a mix of plain and JSON lines still read."""
    head = '{"prompt": "One?", "kind": "chat"}\n'
    for bad, words in (("[1, 2]", "a JSON array"), ("5", "a JSON number"), ('"text"', "a JSON string"),
                       ("null", "JSON null"), ('{"prompt": 5}', '"prompt" must be a non-empty string'),
                       ('{"prompt": null}', '"prompt" must be a non-empty string'),
                       ('{"prompt": ""}', '"prompt" must be a non-empty string'),
                       ('{"kind": "chat"}', 'a JSON line needs a "prompt"')):
        with pytest.raises(ValueError, match=f"prompt file line 3: {words}"):
            prompt_lines(head + "\n" + bad + "\n")
    with pytest.raises(ValueError, match="prompt file line 1: a JSON array"):  # chat messages, not a prompt
        prompt_lines('[{"role": "user", "content": "hi"}]\n')
    plain = 'What is 5 + 5?\n5\n"Quoted" words\n"text"\n[Verse 1] a song\n'
    assert prompt_lines(plain) == [("file", q) for q in plain.splitlines()]
    assert prompt_lines("Plain one?\n" + head) == [("file", "Plain one?"), ("chat", "One?")]


def test_eval_draft_and_benchmark_refuse_a_bad_prompt_line_before_any_load(pair: Path, tmp_path: Path):
    """Before: eval-draft asked "[1, 2]" as a held-out question (exit 0, kind "file" in the
    report); now one line naming the file and the line, before the target loads. The benchmark
    reads its --prompt-file with the same parser."""
    held = tmp_path / "h.jsonl"
    held.write_text('{"prompt": "Hello there", "kind": "chat"}\n[1, 2]\n')
    line = _one_error(_eval(tmp_path, pair, str(held), "--out", "r.json"))
    assert line == f"Error: {held}: prompt file line 2: a JSON array, not a prompt (a JSON line is an " \
                   "object with a \"prompt\")", line
    line = _one_error(_eval(tmp_path, tmp_path / "no_model", str(held)))  # before the target loads
    assert "prompt file line 2: a JSON array" in line, line
    out = _dflash(tmp_path, "benchmark", "--model", str(tmp_path / "no_model"), "--chat",
                  "--prompt-file", str(held), "--out", "res")
    assert "prompt file line 2: a JSON array" in _one_error(out), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.jsonl"]
