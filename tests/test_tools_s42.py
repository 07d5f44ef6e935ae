"""train-draft / eval-draft found wanting in session 42: a session cut short and continued with its
own command line must not grow the draft or restart the cosine a second time; --resume of a run's
folder names its checkpoint; eval-draft says when its report replaces one. Tiny models, few steps."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.training import data as td
from dflash.engine.training.loop import train_draft_command
from dflash.engine.training.report import eval_draft_command
from test_training_walkthrough import campaign, data, target  # noqa: F401  (fixtures: a tiny target, its data, a 4-step campaign)


def _train(target: Path, out: Path, data: Path, *args: str):
    base = ["--target", str(target), "--out", str(out), "--data-dir", str(data), "--seqs-per-batch", "2",
            "--anchors-per-seq", "4", "--max-len", "64", "--num-prompts", "6", "--max-new-tokens", "16",
            "--eval-prompts", "0", "--dtype", "float32", "--no-compile", "--log-every", "1",
            "--compile-steps", "0"]
    return CliRunner().invoke(train_draft_command, base + list(args))


def _trainer(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "trainer.json").read_text())


def _layers(out: Path) -> int:
    return json.loads((out / "checkpoint" / "config.json").read_text())["num_hidden_layers"]


def _stop_at(monkeypatch, step: int, how: str) -> None:
    """Ctrl-C once (stop after the step, save) or twice (quit at once: the periodic checkpoint
    stays) while the batch of global update `step + 1` is drawn."""
    batch = td.FixedBatches.batch

    def stopping(self, s, misses=None):
        if s == step:
            if how == "twice":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGINT)
        return batch(self, s, misses)

    monkeypatch.setattr(td.FixedBatches, "batch", stopping)


@pytest.mark.parametrize("flags, how", [(["--grow-layers", "1"], "once"),
                                        (["--restart-lr", "1e-3"], "once"),
                                        (["--grow-layers", "1"], "twice")])
def test_a_cut_short_session_continued_with_its_own_command_is_not_grown_twice(
        target: Path, campaign: Path, data: Path, tmp_path: Path, monkeypatch, flags: list[str], how: str):
    """Before: the session's command given again with --resume OUT/checkpoint (what its last line
    says to do) grew the draft a second time (1 -> 2 -> 3 layers), refused now; a --restart-lr
    given again restarts the cosine again, which a new session may mean: allowed, with a note."""
    out = tmp_path / "run"
    _stop_at(monkeypatch, 6, how)  # the campaign is at step 4: stopped in this session's 3rd update
    r = _train(target, out, data, "--resume", str(campaign / "checkpoint"), *flags, "--total-steps", "50",
               "--ckpt-every", "1")
    assert r.exit_code == 130, r.output
    if how == "once":
        assert f"without {'--grow-*' if 'grow' in flags[0] else '--restart-lr'} (applied already)" in r.output
    monkeypatch.undo()
    step, layers, schedule = _trainer(out)["step"], _layers(out), _trainer(out)["schedule"]
    assert layers == (2 if "grow" in flags[0] else 1) and step in (6, 7)
    r = _train(target, out, data, "--resume", str(out / "checkpoint"), *flags, "--total-steps", "50",
               "--max-steps", "1")
    if "grow" not in flags[0]:  # a restart again may be meant (a new session): allowed, noted
        assert r.exit_code == 0 and "cut short" in r.output and "restarts the cosine again" in r.output, r.output
        assert _trainer(out)["step"] == step + 1 and _layers(out) == layers
        return
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "cut short" in r.output and "twice" in r.output, r.output
    assert _trainer(out)["step"] == step and _layers(out) == layers
    r = _train(target, out, data, "--resume", str(out / "checkpoint"), "--max-steps", "1")
    assert r.exit_code == 0, r.output
    assert _trainer(out)["step"] == step + 1 and _layers(out) == layers
    assert _trainer(out)["schedule"]["cycle_from"] == schedule["cycle_from"]


def test_a_session_that_ended_as_planned_may_grow_again(target: Path, campaign: Path, data: Path,
                                                        tmp_path: Path):
    out = tmp_path / "run"
    r = _train(target, out, data, "--resume", str(campaign / "checkpoint"), "--grow-layers", "1",
               "--total-steps", "50", "--max-steps", "1")
    assert r.exit_code == 0 and _layers(out) == 2, r.output
    r = _train(target, out, data, "--resume", str(out / "checkpoint"), "--grow-layers", "1", "--max-steps", "1")
    assert r.exit_code == 0 and _layers(out) == 3, r.output


def test_a_resume_of_the_run_folder_names_its_checkpoint(target: Path, campaign: Path, data: Path,
                                                         tmp_path: Path):
    """Before: "OUT/checkpoint already holds another campaign" for the campaign's own folder, and
    "no trainer.json" with no word of the checkpoint inside."""
    out = tmp_path / "run"
    shutil.copytree(campaign, out)
    before = _trainer(out)
    r = _train(target, out, data, "--resume", str(out), "--total-steps", "8")
    assert r.exit_code == 1 and f"pass --resume {out / 'checkpoint'}" in r.output, r.output
    assert "another campaign" not in r.output
    other = tmp_path / "other"
    r = _train(target, other, data, "--resume", str(out), "--total-steps", "8")
    assert r.exit_code == 1 and f"pass --resume {out / 'checkpoint'}" in r.output, r.output
    assert _trainer(out) == before and not other.exists()


def test_eval_draft_says_its_report_replaces_an_existing_one(target: Path, campaign: Path, tmp_path: Path):
    """Before: an earlier report was replaced without a word (and a rerun stopped after one prompt
    replaced a whole report with that prompt's)."""
    rep = tmp_path / "rep.json"
    args = ["--target", str(target), "--draft", str(campaign / "checkpoint"), "--prompts", "1",
            "--max-tokens", "4", "--out", str(rep)]
    r = CliRunner().invoke(eval_draft_command, args)
    assert r.exit_code == 0 and "will replace it" not in r.output, r.output
    r = CliRunner().invoke(eval_draft_command, args)
    assert r.exit_code == 0 and f"[eval] {rep} exists: this evaluation's report will replace it" in r.output
    assert json.loads(rep.read_text())["prompts"] == 1


@pytest.fixture
def sigint_default():
    """Ctrl-C as a terminal gives it: a run in the background (CI under nohup, `... &`) starts with
    SIGINT ignored, which stops_once keeps ignored (as it must), and then no Ctrl-C would stop."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_a_second_ctrl_c_while_the_benchmark_writes_loses_nothing(target: Path, tmp_path: Path, monkeypatch,
                                                                   sigint_default):
    """A real Ctrl-C after the first timed run, and a second one while the result is gathered.
    Before: the second one quit at once, nothing written, every finished run lost (a real double
    Ctrl-C 5 ms apart did it). Now it is ignored: the JSON is written whole, `interrupted: true`."""
    from dflash.engine.bench import run as bench_run
    from dflash.engine.bench.rows import Bench
    from dflash.engine.bench.setup import BenchConfig
    from dflash.engine.tiny import build_draft

    draft = build_draft(tmp_path / "draft", target)
    timed_run, result = Bench.timed_run, bench_run._result

    def first(self, *a):
        timed_run(self, *a)
        signal.raise_signal(signal.SIGINT)

    def second(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return result(*a, **k)

    monkeypatch.setattr(Bench, "timed_run", first)
    monkeypatch.setattr(bench_run, "_result", second)
    cfg = BenchConfig(model=str(target), draft=str(draft), contexts=[64], max_tokens=8, repeats=2,
                      cooldown=0.0, verify_iters=0, plot=False, out=str(tmp_path / "res"))
    try:
        bench_run.run_benchmark(cfg, log=lambda s: None)
    except bench_run.Interrupted as e:
        saved = json.loads(e.path.read_text())
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C quit without writing what was measured")
    else:
        pytest.fail("the Ctrl-C did not stop the runs")
    assert saved["interrupted"] is True and len(saved["runs"]) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_draft_vocab_says_it_replaced_an_earlier_file(campaign: Path, data: Path, tmp_path: Path):
    """Before: a draft's draft_vocab.json (the bundled draft's is committed) was replaced without a word."""
    from dflash.engine.cli import main

    d = tmp_path / "draft"
    shutil.copytree(campaign / "checkpoint", d)
    args = ["draft-vocab", "--data", str(data), "--draft", str(d)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "replaced" not in r.output, r.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "draft_vocab.json (replaced the earlier one):" in r.output, r.output


FLOAT_OPTIONS = ["--time-budget-s", "--restart-lr", "--lr", "--warmup", "--min-lr-ratio", "--weight-decay",
                 "--grad-clip", "--gamma", "--kl-weight", "--miss-anchor-frac", "--early-anchor-frac",
                 "--short-block-frac", "--sampled-responses", "--response-temperature", "--part-mb"]


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_no_float_option_takes_nan_or_inf(target: Path, tmp_path: Path, value: str):
    """nan passes click's float ranges (every comparison with it is false). Before: --lr nan or
    --restart-lr nan trained NaN weights into the checkpoint, --part-mb inf failed at the save
    after all the training (a traceback), --time-budget-s nan never stopped ("nans left")."""
    for flag in FLOAT_OPTIONS:
        r = _train(target, tmp_path / "o", tmp_path / "d", flag, value, "--max-steps", "1")
        assert r.exit_code == 2 and f"Invalid value for '{flag}'" in r.output, (flag, r.output)
    assert not (tmp_path / "o").exists() and not (tmp_path / "d").exists()


def test_a_restart_at_nan_leaves_the_campaign_as_it_was(target: Path, campaign: Path, data: Path, tmp_path: Path):
    out = tmp_path / "run"
    shutil.copytree(campaign, out)
    before = (out / "checkpoint" / "model-00001-of-00001.safetensors").read_bytes()
    r = _train(target, out, data, "--resume", str(out / "checkpoint"), "--restart-lr", "nan",
               "--total-steps", "8", "--max-steps", "1")
    assert r.exit_code == 2, r.output
    assert (out / "checkpoint" / "model-00001-of-00001.safetensors").read_bytes() == before


def test_a_diverged_run_keeps_the_last_good_checkpoint(target: Path, campaign: Path, data: Path, tmp_path: Path):
    """Before: NaN weights replaced the campaign's checkpoint at the next save, then a NaN draft was
    published and evaluated (tau 1.00), with no word but `loss nan` in the progress lines."""
    out = tmp_path / "run"
    shutil.copytree(campaign, out)
    before = {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir()}
    draft_before = (out / "model.safetensors").read_bytes()
    r = _train(target, out, data, "--resume", str(out / "checkpoint"), "--restart-lr", "1e30",
               "--total-steps", "50", "--max-steps", "6", "--ckpt-every", "2")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "not finite at step" in r.output and "left as it was" in r.output, r.output
    assert {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir()} == before
    assert (out / "model.safetensors").read_bytes() == draft_before


def test_a_second_ctrl_c_while_eval_draft_writes_loses_nothing(target: Path, campaign: Path, tmp_path: Path,
                                                               monkeypatch, sigint_default):
    """A real Ctrl-C after the first prompt and a second one while its report is made. Before:
    "cancelled (nothing written)", the finished prompts lost."""
    from dflash.engine.training import report

    one_prompt, make_report = report._one_prompt, report._report

    def first(*a, **k):
        one_prompt(*a, **k)
        signal.raise_signal(signal.SIGINT)

    def second(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return make_report(*a, **k)

    monkeypatch.setattr(report, "_one_prompt", first)
    monkeypatch.setattr(report, "_report", second)
    rep = tmp_path / "rep.json"
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(campaign / "checkpoint"),
                                                "--prompts", "3", "--max-tokens", "4", "--out", str(rep)])
    assert r.exit_code == 130 and "finished prompts written" in r.output, r.output
    saved = json.loads(rep.read_text())
    assert saved["interrupted"] is True and saved["prompts"] == 1 and saved["prompts_asked"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_max_len_shorter_than_every_prompt_is_named(target: Path, campaign: Path, data: Path, tmp_path: Path):
    """Before: "no training sequences with a response: generate more data", with data enough."""
    r = _train(target, tmp_path / "o", data, "--block-size", "8", "--num-capture", "3", "--max-len", "8",
               "--max-steps", "1")
    assert r.exit_code == 1 and "--max-len 8 cuts every one before its answer" in r.output, r.output


def test_another_targets_data_cache_is_said(target: Path, campaign: Path, data: Path, tmp_path: Path):
    """The data cache is keyed by prompt alone: a tiny llama pointed at the qwen3 campaign's cache
    trained on the qwen3 target's answers without a word. Now answerer.json names the target
    that answered (written at the cache's first use) and a different one is warned about; the
    same target, with a longer answer limit, gets a note only."""
    from dflash.engine.tiny import build_target

    record = json.loads((data / "answerer.json").read_text())
    assert record["arch"]["model_type"] == "qwen3" and record["max_new_tokens"] == 16
    other = build_target(tmp_path / "llama", "llama")
    new = ["--layers", "1", "--block-size", "8", "--num-capture", "3", "--max-steps", "1"]
    r = _train(other, tmp_path / "run", data, *new)
    assert "answered by another target" in r.output, r.output
    r = _train(target, tmp_path / "run2", data, *new, "--max-new-tokens", "24")
    assert "another target" not in r.output and "cut at 16 new tokens" in r.output, r.output
    assert json.loads((data / "answerer.json").read_text()) == record  # the first answerer stays
