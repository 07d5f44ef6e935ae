"""train-draft / eval-draft refuse bad input in one line, before any work, changing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.tiny import build_draft, build_target
from dflash.engine.training import TrainOptions, train_draft
from dflash.engine.training.loop import train_draft_command
from dflash.engine.training.report import eval_draft_command


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("tiny") / "target", "qwen3")


@pytest.fixture(scope="module")
def campaign(target: Path, tmp_path_factory) -> Path:
    """A real 4-step campaign (block 8, 1 layer, 3 taps): OUT with OUT/checkpoint at step 4 of 4."""
    out = tmp_path_factory.mktemp("camp") / "run"
    train_draft(TrainOptions(
        target=str(target), out=str(out), layers=1, block_size=8, num_capture=3, lr=1e-2, warmup=1,
        seqs_per_batch=2, anchors_per_seq=4, max_len=64, num_prompts=6, max_new_tokens=16,
        gen_batch_size=6, eval_prompts=0, log_every=2, ckpt_every=0, dtype="float32",
        total_steps=4, compile=False), log=lambda s: None)
    return out


def _train(target: Path, out: Path | str, *args: str):
    base = ["--target", str(target), "--out", str(out), "--block-size", "8", "--num-capture", "3",
            "--seqs-per-batch", "2", "--anchors-per-seq", "4", "--max-len", "64", "--num-prompts", "6",
            "--max-new-tokens", "16", "--eval-prompts", "0", "--dtype", "float32", "--no-compile",
            "--max-steps", "1"]  # short, should a check be missing
    return CliRunner().invoke(train_draft_command, base + list(args))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_error(r, *words: str) -> None:
    assert r.exit_code != 0 and isinstance(r.exception, (SystemExit, type(None))), r.output
    assert "Traceback" not in r.output
    for w in words:
        assert w in r.output, r.output


def test_a_fresh_run_never_overwrites_a_campaign(target: Path, campaign: Path):
    before = _snapshot(campaign)
    r = _train(target, campaign, "--total-steps", "8")
    _one_line_error(r, "step 4", f"--resume {campaign / 'checkpoint'}", "another --out")
    assert _snapshot(campaign) == before


def test_a_resume_never_overwrites_another_campaign(target: Path, campaign: Path, tmp_path: Path):
    other = tmp_path / "other"
    (other / "checkpoint").mkdir(parents=True)
    (other / "checkpoint" / "trainer.json").write_text('{"step": 6, "sessions": [{}, {}, {}]}')
    r = _train(target, other, "--resume", str(campaign / "checkpoint"), "--total-steps", "8")
    _one_line_error(r, "another campaign at step 6", "another --out")
    assert json.loads((other / "checkpoint" / "trainer.json").read_text())["step"] == 6


def test_an_empty_out_is_a_usage_error(target: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _train(target, "", "--total-steps", "2")
    _one_line_error(r, "--out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, name", [
    (["--num-capture", "0"], "--num-capture"), (["--num-capture", "-2"], "--num-capture"),
    (["--seqs-per-batch", "0"], "--seqs-per-batch"), (["--anchors-per-seq", "0"], "--anchors-per-seq"),
    (["--lr", "-1"], "--lr"), (["--warmup", "-1"], "--warmup"), (["--time-budget-s", "-5"], "--time-budget-s"),
    (["--ckpt-every", "-1"], "--ckpt-every"), (["--log-every", "0"], "--log-every"),
    (["--part-mb", "0"], "--part-mb"), (["--gamma", "0"], "--gamma"), (["--eval-prompts", "-1"], "--eval-prompts"),
    (["--num-prompts", "-1"], "--num-prompts"),
])
def test_option_ranges(target: Path, tmp_path: Path, args: list[str], name: str):
    r = _train(target, tmp_path / "o", *args)
    assert r.exit_code == 2 and name in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_no_prompts_at_all_is_refused_but_zero_builtin_with_a_file_is_fine(target: Path, tmp_path: Path):
    r = _train(target, tmp_path / "o", "--num-prompts", "0")
    _one_line_error(r, "--num-prompts 0", "no training data")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"kind": "chat", "prompt": "one two three"}\n{"kind": "chat", "prompt": "four"}\n')
    r = _train(target, tmp_path / "o2", "--num-prompts", "0", "--prompts", str(prompts), "--data-only")
    assert r.exit_code == 0, r.output


def test_more_captured_layers_than_the_target_has(target: Path, tmp_path: Path):
    r = _train(target, tmp_path / "o", "--num-capture", "99")
    _one_line_error(r, "--num-capture 99", "4 layers")


@pytest.mark.parametrize("args, words", [
    (["--block-size", "16"], ["--block-size 16", "(8)"]),
    (["--layers", "3"], ["--layers 3", "(1)"]),
    (["--num-capture", "5"], ["--num-capture 5"]),
])
def test_a_resume_refuses_a_contradicting_architecture(target: Path, campaign: Path, tmp_path: Path,
                                                       args: list[str], words: list[str]):
    ckpt = campaign / "checkpoint"
    base = ["--target", str(target), "--out", str(tmp_path / "o"), "--resume", str(ckpt),
            "--total-steps", "8", "--dtype", "float32", "--max-steps", "1", "--eval-prompts", "0"]
    r = CliRunner().invoke(train_draft_command, base + args)
    _one_line_error(r, *words)
    assert not (tmp_path / "o").exists()


def test_flags_that_need_or_exclude_a_resume(target: Path, campaign: Path, tmp_path: Path):
    ckpt = str(campaign / "checkpoint")
    r = _train(target, tmp_path / "a", "--resume", ckpt, "--init-draft", ckpt, "--total-steps", "8")
    _one_line_error(r, "--init-draft", "--resume")
    r = _train(target, tmp_path / "b", "--restart-lr", "1e-3", "--total-steps", "8")
    _one_line_error(r, "--restart-lr", "--resume")


@pytest.mark.parametrize("extra", [[], ["--total-steps", "3"]])
def test_a_resume_at_the_end_is_refused_and_changes_nothing(target: Path, campaign: Path, extra: list[str]):
    ckpt = campaign / "checkpoint"
    before = _snapshot(campaign)
    r = CliRunner().invoke(train_draft_command, ["--target", str(target), "--out", str(campaign),
                                                 "--resume", str(ckpt), "--dtype", "float32",
                                                 "--max-steps", "1", "--eval-prompts", "0"] + extra)
    _one_line_error(r, "at step 4 of", "--total-steps")
    assert _snapshot(campaign) == before


def test_a_corrupt_trainer_json_is_named(target: Path, tmp_path: Path):
    ckpt = tmp_path / "run" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text("{step: 6,")
    r = _train(target, tmp_path / "run", "--total-steps", "8")
    _one_line_error(r, str(ckpt / "trainer.json"))
    r = _train(target, tmp_path / "other", "--resume", str(ckpt), "--total-steps", "8")
    _one_line_error(r, str(ckpt / "trainer.json"))


def test_eval_draft_refuses_a_foreign_draft_and_an_empty_prompt_file(target: Path, tmp_path: Path):
    other = build_target(tmp_path / "wide", "qwen3", hidden_size=128)
    build_draft(tmp_path / "wide_draft", other)
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(tmp_path / "wide_draft"),
                                                "--prompts", "1", "--max-tokens", "4"])
    _one_line_error(r, "draft does not fit the target", "hidden size 128")
    build_draft(tmp_path / "own_draft", target)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rep = tmp_path / "rep.json"
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(tmp_path / "own_draft"),
                                                "--heldout-file", str(empty), "--out", str(rep)])
    _one_line_error(r, "no prompts in", str(empty))
    assert not rep.exists()
