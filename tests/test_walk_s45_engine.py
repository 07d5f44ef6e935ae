"""Session 45's engine walk: a negative tok/s on an empty answer, `dflash generate` penalties
refused only after the model loaded, its --json "sampling" without the logits processors, a
held-out line's leaked KeyError, and eval-draft / train-draft not saying where they wrote.
Tiny random-weight models, in process (CliRunner on the subcommands: no BLAS re-exec)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.cli import generate
from dflash.engine.prompting import prompt_lines
from helpers import run_dflash
from test_cli_s44_eval import pair  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def target(pair: Path) -> Path:
    """test_cli_s44_eval's tiny qwen3 target with its 1-layer random draft in <dir>/draft."""
    return pair


# --- 1. decode speed of an empty or one-token answer ------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 8])
def test_decode_tps_is_never_negative_for_zero_or_one_token(pairs, max_tokens: int):
    """Before: (generated - 1) / t, so an answer cut at once by EOS (0 tokens) read -992.9 tok/s.
    A bias that makes EOS certain ends the answer before its first token; max_tokens 1 keeps one."""
    pair = pairs("qwen3")
    eos = sorted(pair.tokenizer.eos_token_ids)[0]
    ids = pair.tokenizer.encode("Write a short story about a robot.")
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, max_tokens,
                          logit_bias={eos: 1e4} if max_tokens > 1 else None)
    s = final.stats
    assert s.generated_tokens == (0 if max_tokens > 1 else 1), s.generated_tokens
    assert s.decode_tps == 0.0, s.decode_tps


# --- 2. sampling / processor options refused as usage errors, before any load ----------------
@pytest.mark.parametrize("args, words", [
    (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
    (["--repetition-penalty", "-1"], "repetition_penalty must be a finite number > 0"),
    (["--repetition-penalty", "1e-40"], "repetition_penalty must be within"),
    (["--presence-penalty", "1e31"], "presence_penalty must be within"),
    (["--frequency-penalty", "-1e31"], "frequency_penalty must be within"),
    (["--frequency-penalty", "nan"], "frequency_penalty must be a finite number"),
    (["--repetition-context-size", "0"], "--repetition-context-size"),
    (["--presence-context-size", "-3"], "--presence-context-size"),
    (["--frequency-context-size", "0"], "--frequency-context-size"),
    (["-t", "-1"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--top-k", "-1"], "--top-k"),
    (["--min-p", "1.5"], "--min-p"), (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
])
def test_bad_sampling_values_exit_2_before_the_model_loads(tmp_path: Path, args: list[str], words: str):
    """Before: --repetition-penalty 0 (or 1e-40, --presence-penalty 1e31) failed with exit 1
    only once the model had loaded; here the model folder does not exist, so a value checked
    only after loading would say "model directory not found" instead."""
    res = CliRunner().invoke(generate, ["--model", str(tmp_path / "no_model"), "-p", "hi", *args])
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Invalid value" in res.output and words in res.output, res.output
    assert "not found" not in res.output, res.output


# --- 3. --json reports the logits processors in "sampling" -------------------------------------
def test_generate_json_sampling_reports_the_processors(target: Path):
    """Before: only temperature, top_p, top_k, seed, min_p, min_tokens_to_keep; the daemon's
    done.stats.sampling (and so dflash-client --json and the gateway) has the processors too."""
    res = CliRunner().invoke(generate, [
        "--model", str(target), "--draft", str(target / "draft"), "--raw", "-p", "Hello", "-m", "4",
        "--json", "-t", "1", "--seed", "3", "--min-p", "0.05", "--repetition-penalty", "1.2",
        "--logit-bias", "13=-100", "--presence-penalty", "0.5", "--presence-context-size", "7"])
    assert res.exit_code == 0, res.output
    sampling = json.loads(res.stdout.strip().splitlines()[-1])["sampling"]
    assert sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 3, "min_p": 0.05,
                        "min_tokens_to_keep": 1, "repetition_penalty": 1.2, "repetition_context_size": 20,
                        "presence_penalty": 0.5, "presence_context_size": 7,
                        "logit_bias": {"13": -100.0}}, sampling


def test_generate_json_sampling_without_processors_is_unchanged(target: Path):
    """Off processors (repetition 1, presence 0) are left out, as the daemon leaves them out."""
    res = CliRunner().invoke(generate, [
        "--model", str(target), "--draft", str(target / "draft"), "--raw", "-p", "Hello", "-m", "2",
        "--json", "--repetition-penalty", "1", "--presence-penalty", "0"])
    assert res.exit_code == 0, res.output
    sampling = json.loads(res.stdout.strip().splitlines()[-1])["sampling"]
    assert set(sampling) == {"temperature", "top_p", "top_k", "seed", "min_p", "min_tokens_to_keep"}


# --- 4. held-out lines, and saying where eval-draft / train-draft wrote ------------------------
def test_a_json_line_without_prompt_does_not_leak_a_keyerror():
    """Before: `a JSON line needs a "prompt" ('prompt')`, the KeyError's repr in parentheses."""
    with pytest.raises(ValueError) as e:
        prompt_lines('{"kind": "chat"}\n')
    assert str(e.value) == 'prompt file line 1: a JSON line needs a "prompt" (its keys: "kind")', str(e.value)
    assert "('prompt')" not in str(e.value)


def test_eval_draft_out_says_where_the_report_went(target: Path, tmp_path: Path):
    """Before: the report was written silently; now one last line names the file."""
    from dflash.engine.training.report import eval_draft_command

    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "Hello there?", "kind": "chat"}\n')
    out = tmp_path / "report.json"
    res = CliRunner().invoke(eval_draft_command, [
        "--target", str(target), "--draft", str(target / "draft"), "--heldout-file", str(held),
        "--max-tokens", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.is_file()
    assert res.output.strip().splitlines()[-1] == f"[eval] report written to {out}", res.output[-500:]


def test_train_draft_says_where_the_draft_went(monkeypatch, tmp_path: Path):
    """Before: the last line named only the checkpoint; now the finished draft's folder too (the
    training itself is stubbed: what is checked is the command's report of its summary)."""
    from dflash.engine.training import loop

    out = tmp_path / "run"
    summary = {"draft_dir": str(out), "stop_reason": "max_steps", "heldout": {}}
    monkeypatch.setattr(loop, "train_draft", lambda opts, log, explicit_arch=None: summary)
    res = CliRunner().invoke(loop.train_draft_command, ["--target", str(tmp_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == f"[train] draft written to {out}", res.output
    summary.pop("heldout")  # interrupted before the draft was saved: nothing claimed
    summary["stop_reason"] = "interrupted"
    res = CliRunner().invoke(loop.train_draft_command, ["--target", str(tmp_path), "--out", str(out)])
    assert res.exit_code == 130 and "draft written" not in res.output, res.output
