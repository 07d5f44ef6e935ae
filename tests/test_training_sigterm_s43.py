"""SIGTERM (`timeout`, `kill`, a supervisor) while train-draft prepares its data ends as Ctrl-C
does there: "cancelled", exit 130, every finished batch of responses kept whole for the rerun.
Before session 43 only the derive step did; elsewhere before training SIGTERM killed the process
without a word (exit -15). Real processes on the tiny target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_training_walkthrough import target  # noqa: F401  (fixture: a tiny target)

CANCELLED = "cancelled; the data cached so far stays in"


def _args(target: Path, out: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash.engine.cli", "train-draft", "--target", str(target),
            "--out", str(out), "--data-dir", str(data), "--gen-batch-size", "4",
            "--max-new-tokens", "16", "--dtype", "float32", "--num-capture", "3", "--block-size", "8",
            "--data-only", *extra]


def _stop_when(args: list[str], sig: str, ready) -> tuple[subprocess.Popen, str, list[str]]:
    """Run `args`, send `sig` at the first stderr line `ready` accepts; (process, output, lines
    read before the signal). SIGINT starts as Python's default (a background run ignores it)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if ready(line):
            proc.send_signal(getattr(signal, sig))
            break
    _, err = proc.communicate(timeout=180)
    return proc, "".join(lines) + err, lines


def _answered(line: str) -> tuple[int, int] | None:
    """(k, N) of a "[data] responses k/N | ..." line, else None."""
    if not line.startswith("[data] responses "):
        return None
    k, n = line.split()[2].split("/")
    return int(k), int(n)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_while_responses_are_generated_keeps_the_finished_batches(target: Path, tmp_path: Path,
                                                                          sig: str):
    """Stopped after its second batch of 4 responses (of 600). Before: SIGTERM ended the process
    with exit -15 and no message. Now SIGTERM ends as Ctrl-C: exit 130, one "cancelled" line,
    every response it reported is in responses.jsonl as a whole line, and the rerun answers
    only the prompts still missing, appending after them."""
    out, data = tmp_path / "run", tmp_path / "data"
    proc, output, lines = _stop_when(_args(target, out, data), sig,
                                     lambda line: (_answered(line) or (0, 0))[0] >= 8)
    said, total = _answered(lines[-1]) or (0, 0)
    assert said >= 8 and total > said, output
    assert proc.returncode == 130, output
    assert "Traceback" not in output and output.count(CANCELLED) == 1, output
    cache = data / "responses.jsonl"
    text = cache.read_text()
    assert text.endswith("\n"), text[-200:]  # no torn last line
    kept = [json.loads(x) for x in text.splitlines()]
    assert said <= len(kept) < total and all(r["response_ids"] for r in kept)
    assert len({r["prompt"] for r in kept}) == len(kept)

    p = subprocess.run(_args(target, out, data), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    again = [a for a in map(_answered, p.stderr.splitlines()) if a]
    assert again and again[-1] == (total - len(kept), total - len(kept)), p.stderr
    after = cache.read_text()
    assert after.startswith(text)
    assert len({json.loads(x)["prompt"] for x in after.splitlines()}) == total


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_while_prompt_files_are_read_and_tokenised(target: Path, tmp_path: Path, sig: str):
    """Stopped as soon as the target has loaded, while 60,000 prompts (and as many excluded ones)
    are read and put through the chat template, or the first responses are generated. Before:
    SIGTERM gave exit -15 without a word. Now: exit 130 and the one "cancelled" line, no
    traceback, and the cache holds whole lines only."""
    out, data = tmp_path / "run", tmp_path / "data"
    prompts, excluded = tmp_path / "prompts.jsonl", tmp_path / "excluded.jsonl"
    for path, what in ((prompts, "item"), (excluded, "other thing")):
        path.write_text("".join(json.dumps({"kind": "chat", "prompt": f"Tell me about {what} {i}"}) + "\n"
                                for i in range(60_000)))
    proc, output, _ = _stop_when(
        _args(target, out, data, "--prompts", str(prompts), "--exclude-prompts", str(excluded),
              "--num-prompts", "0"),
        sig, lambda line: line.startswith("[train] target "))
    assert proc.returncode == 130, output
    assert "Traceback" not in output and output.count(CANCELLED) == 1, output
    cache = data / "responses.jsonl"
    if cache.is_file():
        text = cache.read_text()
        assert not text or text.endswith("\n")
        assert all(json.loads(x)["response_ids"] for x in text.splitlines())
