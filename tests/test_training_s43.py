"""train-draft work lost to an interruption, found in session 42: prompts derived before a Ctrl-C
or SIGTERM, a time budget overshot by a whole log interval, and a log that repeats the steps re-run
after a kill. Tiny models, real processes where a signal is involved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.training import TrainOptions, train_draft
from dflash.engine.training.loop import train_draft_command
from test_training_walkthrough import data, target  # noqa: F401  (fixtures: a tiny target, its data)

REPO = Path(__file__).resolve().parents[1]


def _trainer(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "trainer.json").read_text())


def _log_lines(out: Path) -> list[str]:
    return (out / "train_log.jsonl").read_text().splitlines()


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in _log_lines(out)]


def _small(target: Path, out: Path, data: Path, **kw) -> TrainOptions:
    base = dict(target=str(target), out=str(out), data_dir=str(data), layers=1, block_size=8, num_capture=3,
                seqs_per_batch=2, anchors_per_seq=4, max_len=64, num_prompts=6, max_new_tokens=16,
                gen_batch_size=6, eval_prompts=0, dtype="float32", compile=False, compile_steps=0)
    return TrainOptions(**{**base, **kw})


# --- 1. --derive-prompts stopped by Ctrl-C or SIGTERM -----------------------------------------------
def _derive_args(target: Path, out: Path, data: Path, n: int) -> list[str]:
    return ["train-draft", "--target", str(target), "--out", str(out), "--data-dir", str(data),
            "--num-prompts", "0", "--derive-prompts", str(n), "--gen-batch-size", "16",
            "--max-new-tokens", "4", "--dtype", "float32", "--num-capture", "3", "--block-size", "8",
            "--data-only"]


def _derived_count(line: str) -> int:
    """k of a "[data] derived prompts k/N (...)" line, else -1."""
    if not line.startswith("[data] derived prompts "):
        return -1
    return int(line.split()[3].split("/")[0])


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_prompts_derived_before_a_stop_are_kept_and_reused(target: Path, tmp_path: Path, sig: str):
    """A real process stopped while the target derives prompts, after it said it had some.
    Before: every derived prompt was lost (they were written once, at the end), and SIGTERM killed
    the process without a word. Now: exit 130, every prompt it reported is in
    derived_prompts.jsonl (whole lines), and the next run takes them instead of deriving again."""
    out, data = tmp_path / "run", tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.engine.cli", *_derive_args(target, out, data, 400)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background run ignores it
    lines, said = [], 0
    for line in proc.stderr:
        lines.append(line)
        said = max(said, _derived_count(line))
        if said >= 2:
            proc.send_signal(getattr(signal, sig))
            break
    _, err = proc.communicate(timeout=180)
    output = "".join(lines) + err
    assert said >= 2, output
    assert proc.returncode == 130 and "Traceback" not in output, output
    assert "cancelled; the data cached so far stays" in output, output
    shard = data / "derived_prompts.jsonl"
    assert shard.is_file(), output
    kept = [json.loads(x) for x in shard.read_text().splitlines()]
    assert len(kept) >= said and all(d["kind"] == "derived" and d["prompt"] for d in kept)
    assert not list(data.glob("derived_prompts*.tmp"))

    # the next run asks for what is cached: nothing derived again, every kept prompt answered
    before = shard.read_text()
    p = subprocess.run([sys.executable, "-m", "dflash.engine.cli",
                        *_derive_args(target, out, data, len(kept))],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    assert "[data] derived prompts" not in p.stderr, p.stderr
    assert f"{len(kept)} derived by the target" in p.stderr, p.stderr
    assert shard.read_text() == before
    answered = {json.loads(x)["prompt"] for x in (data / "responses.jsonl").read_text().splitlines()}
    assert answered == {d["prompt"] for d in kept}


def test_a_derived_prompt_file_cut_mid_line_is_repaired(target: Path, tmp_path: Path):
    """A kill (or a full disk) while a batch of prompts is appended leaves an unfinished last
    line: it is dropped, not read as a prompt nor an error, and the next append starts clean."""
    from dflash.engine.training import data as td

    data = tmp_path / "data"
    data.mkdir()
    shard = data / "derived_prompts.jsonl"
    whole = [json.dumps({"kind": "derived", "prompt": f"Explain thing number {i}"}) for i in range(3)]
    shard.write_text("\n".join(whole) + "\n" + '{"kind": "derived", "prompt": "Expl')
    got = td.cached_derived_prompts(None, None, 3, data)  # model None: deriving would fail
    assert [p for _, p in got] == [f"Explain thing number {i}" for i in range(3)]
    assert shard.read_text() == "\n".join(whole) + "\n"


# --- 2. --time-budget-s checked at every step -------------------------------------------------------
def test_the_time_budget_stops_between_log_steps(target: Path, data: Path, tmp_path: Path):
    """Before: the budget was read at log steps only, so with --log-every above what the budget
    holds the session ran to its last step. Now it stops at the step where the budget runs out,
    logs that step, saves the checkpoint there and says so (a session that ended as planned)."""
    out = tmp_path / "run"
    s = train_draft(_small(target, out, data, total_steps=2000, log_every=1000, ckpt_every=0,
                           time_budget_s=0.3), log=lambda s: None)
    assert s["stop_reason"] == "time budget", (s["steps"], s["stop_reason"])
    assert 0 < s["steps"] < 1000
    trainer = _trainer(out)
    assert trainer["step"] == s["steps"] and trainer["sessions"][-1]["stopped"] == "time budget"
    assert _steps(out) == [s["steps"]]  # the session's last step is logged, as a budget stop's is
    r = CliRunner().invoke(train_draft_command, [
        "--target", str(target), "--out", str(out), "--data-dir", str(data), "--seqs-per-batch", "2",
        "--anchors-per-seq", "4", "--max-len", "64", "--num-prompts", "6", "--max-new-tokens", "16",
        "--eval-prompts", "0", "--dtype", "float32", "--no-compile", "--compile-steps", "0",
        "--log-every", "1", "--resume", str(out / "checkpoint"), "--max-steps", "2"])
    assert r.exit_code == 0, r.output
    assert _trainer(out)["step"] == s["steps"] + 2
    assert _steps(out) == [s["steps"], s["steps"] + 1, s["steps"] + 2]


@pytest.mark.skipif(os.environ.get("DFLASH_TEST_DIST") != "1",
                    reason="2 processes over MLX's ring backend: DFLASH_TEST_DIST=1")
def test_two_ranks_stop_together_at_the_budget_between_log_steps(target: Path, tmp_path: Path):
    """Ranks compare clocks collectively every few steps (not at log steps only) and stop at the
    same step, rank 0 saving the checkpoint there."""
    launch = Path(sys.executable).with_name("mlx.launch")
    out, data = tmp_path / "out", tmp_path / "data"
    cmd = [str(launch), "--backend", "ring", "-n", "2", str(REPO / "scripts" / "train_dist.py"),
           "--target", str(target), "--out", str(out), "--data-dir", str(data), "--block-size", "8",
           "--num-capture", "3", "--num-prompts", "12", "--max-new-tokens", "16", "--max-len", "64",
           "--seqs-per-batch", "2", "--anchors-per-seq", "4", "--total-steps", "3000", "--log-every", "1000",
           "--compile-steps", "0", "--no-compile", "--time-budget-s", "1", "--eval-prompts", "0"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    step = _trainer(out)["step"]
    assert _trainer(out)["sessions"][-1]["stopped"] == "time budget" and 0 < step < 1000
    assert _steps(out) == [step]


# --- 3. the log after a kill and a resume -----------------------------------------------------------
_KILLED_AT_STEP_7 = """
import os, signal, sys
from dflash.engine.training import TrainOptions, train_draft

def log(line):
    print(line, file=sys.stderr, flush=True)
    if line.startswith("[train] step 7/"):  # its record is in train_log.jsonl; the checkpoint is step 5's
        os.kill(os.getpid(), signal.SIGKILL)

train_draft(TrainOptions(target=sys.argv[1], out=sys.argv[2], data_dir=sys.argv[3], layers=1, block_size=8,
                         num_capture=3, seqs_per_batch=2, anchors_per_seq=4, max_len=64, num_prompts=6,
                         max_new_tokens=16, gen_batch_size=6, eval_prompts=0, dtype="float32",
                         compile=False, compile_steps=0, total_steps=50, log_every=1, ckpt_every=5), log=log)
"""


def test_a_resume_after_a_kill_logs_each_step_once(target: Path, data: Path, tmp_path: Path):
    """A real process SIGKILLed after step 7's log record, with the checkpoint at step 5, then
    resumed. Before: steps 6 and 7 were in train_log.jsonl twice. Now the records past the
    checkpoint are dropped on resume (the file swapped whole), those up to it kept as they were."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _KILLED_AT_STEP_7, str(target), str(out), str(data)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert _trainer(out)["step"] == 5 and _steps(out) == list(range(1, 8))
    kept = _log_lines(out)[:5]
    with (out / "train_log.jsonl").open("a") as f:
        f.write('{"step": 8, "loss": 1.')  # and the kill cut a record mid-line
    train_draft(_small(target, out, data, resume=str(out / "checkpoint"), max_steps=4, log_every=1),
                log=lambda s: None)
    assert _steps(out) == list(range(1, 10))
    assert _log_lines(out)[:5] == kept
    assert not list(out.glob("train_log*.tmp"))


def test_a_fresh_run_after_a_kill_before_any_checkpoint_starts_a_clean_log(target: Path, data: Path,
                                                                            tmp_path: Path):
    """No checkpoint was saved before the kill: the rerun starts at step 0 and re-runs every
    logged step, so those records go (before: steps 1..3 twice)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    train_draft(_small(target, out, data, total_steps=4, max_steps=4, log_every=1), log=lambda s: None)
    assert _steps(out) == [1, 2, 3, 4]
    assert all(json.loads(x)["loss"] != 9.0 for x in _log_lines(out))
