"""A resume keeps its campaign's data options (prompts, their count, the answers' length, the
seed) unless typed again: before, `train-draft --resume` without them trained on 600 built-in
prompts answered to 256 tokens, in another order, and said nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.training.loop import train_draft_command

SHAPE = ["--block-size", "8", "--num-capture", "3", "--seqs-per-batch", "2", "--anchors-per-seq", "4",
         "--max-len", "64", "--eval-prompts", "0", "--dtype", "float32", "--no-compile", "--log-every", "1"]
CAMPAIGN = ["--num-prompts", "5", "--max-new-tokens", "12", "--seed", "3"]


@pytest.fixture(scope="module")
def target(tiny_dirs) -> Path:
    return tiny_dirs["qwen3"]  # conftest's tiny target (read only)


@pytest.fixture(scope="module")
def campaign(target: Path, tmp_path_factory) -> Path:
    """Two steps of a 6-step campaign on 5 built-in prompts answered to 12 tokens, seed 3."""
    out = tmp_path_factory.mktemp("camp") / "run"
    r = _train(target, out, *CAMPAIGN, "--total-steps", "6", "--max-steps", "2")
    assert r.exit_code == 0, r.output
    return out


def _train(target: Path, out: Path, *args: str):
    return CliRunner().invoke(train_draft_command, ["--target", str(target), "--out", str(out), *SHAPE, *args])


def _trainer(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "trainer.json").read_text())


def _copy(campaign: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(campaign, out)
    return out


def test_the_checkpoint_records_the_data_options(campaign: Path):
    got = _trainer(campaign)["data_options"]
    assert got["num_prompts"] == 5 and got["max_new_tokens"] == 12 and got["seed"] == 3
    assert got["derive_prompts"] == 0 and got["prompts"] is None and got["train_responses"] == "all"


def test_a_bare_resume_keeps_them_and_says_so(target: Path, campaign: Path, tmp_path: Path):
    out = _copy(campaign, tmp_path)
    before = _trainer(out)
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--max-steps", "2")
    assert r.exit_code == 0, r.output
    line = next(s for s in r.output.splitlines() if "data options kept" in s)
    for flag in ("--num-prompts 5", "--max-new-tokens 12", "--seed 3"):
        assert flag in line, line
    after = _trainer(out)
    assert after["step"] == before["step"] + 2
    assert after["data_options"] == before["data_options"]
    # the same training set: no 600 built-in prompts answered (the old default) joined it
    assert after["data"] == before["data"]
    assert after["seed"] == 3


def test_a_typed_option_wins_and_is_not_listed(target: Path, campaign: Path, tmp_path: Path):
    out = _copy(campaign, tmp_path)
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--max-steps", "1",
               "--max-new-tokens", "14", "--seed", "0")
    assert r.exit_code == 0, r.output
    line = next(s for s in r.output.splitlines() if "data options kept" in s)
    assert "--num-prompts 5" in line and "--max-new-tokens" not in line and "--seed" not in line
    got = _trainer(out)["data_options"]
    assert got["max_new_tokens"] == 14 and got["seed"] == 0 and got["num_prompts"] == 5


def test_an_older_checkpoint_keeps_its_seed_and_answer_length(target: Path, campaign: Path, tmp_path: Path):
    """trainer.json before the record held the seed and data.max_new_tokens: those are kept."""
    out = _copy(campaign, tmp_path)
    f = out / "checkpoint" / "trainer.json"
    old = json.loads(f.read_text())
    del old["data_options"]
    f.write_text(json.dumps(old))
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--max-steps", "1", "--num-prompts", "5")
    assert r.exit_code == 0, r.output
    line = next(s for s in r.output.splitlines() if "data options kept" in s)
    assert "--seed 3" in line and "--max-new-tokens 12" in line and "--num-prompts" not in line
    assert _trainer(out)["data"]["max_new_tokens"] == 12


def test_a_broken_trainer_json_is_still_named_by_the_resume_check(target: Path, campaign: Path, tmp_path: Path):
    out = _copy(campaign, tmp_path)
    (out / "checkpoint" / "trainer.json").write_text("{not json")
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--max-steps", "1")
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "trainer.json" in r.output and "not a readable trainer.json" in r.output, r.output
