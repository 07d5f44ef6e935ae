"""Session 48: `dflash train-draft` refuses, before any data or compile work, a step whose memory
cannot fit (engine/training/memory.py). Before: `--seqs-per-batch 100000000`, or `--block-size
100000 --max-len 200000`, ran MLX out of memory (the process killed, or the machine swapping)
instead of saying a word.

The estimate is checked against numbers worked out by hand; the CLI tests run real processes on a
tiny random-weight target written by `dflash make-tiny` (no mocks), each under an address-space
limit so that the code before the fix fails fast instead of taking the machine's memory."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from test_cli_s44_bench import _one_error  # one clean failure: exit 1, one Error: line

from dflash.engine.training.memory import (ENV, GIB, StepShape, check_step_memory, refusal, seqs_that_fit,
                                           step_memory)

# a tiny shape, every part small enough to add up by hand (fp32 everywhere)
TINY = StepShape(seqs=2, seq_len=32, anchors=4, block_size=8, hidden=64, vocab=516, num_capture=3,
                 target_intermediate=128, draft_layers=1, draft_intermediate=128, heads=2, kv_heads=1,
                 head_dim=64, target_weight_bytes=1000, draft_params=100, target_bytes=4, compute_bytes=4)

# the SmolLM2-135M campaign (benchmark/training/campaign/session47/devq/env): 32 sequences x 64
# blocks of 16 at 640 tokens, bf16, the draft grown to 8 layers of MLP 2304, on an 80 GB H100
D, KV = 576, 192
_LAYER = 2 * D * D + 2 * D * KV + 3 * D * 2304 + 2 * D + 2 * 64
CAMPAIGN = StepShape(seqs=32, seq_len=640, anchors=64, block_size=16, hidden=D, vocab=49152, num_capture=5,
                     target_intermediate=1536, draft_layers=8, draft_intermediate=2304, heads=9, kv_heads=3,
                     head_dim=64, target_weight_bytes=2 * 134_515_008, draft_params=8 * _LAYER + 5 * D * D + D)


# --- the estimate -----------------------------------------------------------------------------
def test_the_estimate_adds_up_by_hand():
    parts = step_memory(TINY)
    # fp32 masters 4 + gradients 4 + AdamW moments 8 bytes per parameter (no compute copy in fp32)
    assert parts["weights"] == 1000 + 100 * 16 == 2600
    # [2, 32] tokens: 3 captured layers + the last hidden (64 each) + gate and up (128 each), fp32
    assert parts["target"] == 2 * 32 * (3 * 64 + 64 + 2 * 128) * 4 == 131_072
    # 4 blocks of 8 = 32 rows per sequence against 32 + 32 = 64 keys:
    mask = 2 * 32 * 64  # bool mask
    context = 2 * 32 * 64 * 4  # the projected context
    layer = 2 * (2 * 1 * 64 * 64 + 32 * (64 + 2 * 128)) * 4  # keys + values, inputs + MLP rows
    softmax = 2 * 2 * 32 * 64 * 4 * (1 + 1)  # [S, H, rows, keys] for the one layer and one more
    assert parts["attention"] == mask + context + layer + softmax == 233_472
    # [2, 4, 7] labelled rows x 516 logits, fp32, and their gradient
    assert parts["logits"] == 2 * 4 * 7 * 516 * 4 * 2 == 231_168


def test_bf16_compute_and_kl_add_what_they_hold():
    both = step_memory(replace(TINY, compute_bytes=2, target_logits=True))
    assert both["weights"] == 1000 + 100 * (16 + 2)  # the bf16 copy the loss runs on
    assert both["logits"] == 2 * 4 * 7 * 516 * 4 * 3  # + the target's log-probabilities
    assert both["attention"] == (2 * 32 * 64 + 2 * 32 * 64 * 2 + 2 * (2 * 64 * 64 + 32 * 320) * 2
                                 + 2 * 2 * 32 * 64 * 2 * 2)


def test_seqs_that_fit_is_linear_past_the_weights():
    per_seq = sum(step_memory(replace(TINY, seqs=1)).values()) - 2600
    assert per_seq == (131_072 + 233_472 + 231_168) // 2
    assert seqs_that_fit(TINY, 2600 + 3 * per_seq + 5) == 3
    assert seqs_that_fit(TINY, 2600 + per_seq - 1) == 0
    assert seqs_that_fit(TINY, 100) == 0  # not even the weights


def test_todays_campaign_fits_an_h100_with_room_to_spare():
    need = sum(step_memory(CAMPAIGN).values())
    assert 20 * GIB < need < 26 * GIB, need / GIB
    assert refusal(CAMPAIGN, 80 * 10**9, "the GPU's memory (total_memory)") is None
    assert refusal(replace(CAMPAIGN, target_logits=True), 80 * 10**9, "x") is None  # --kl-weight
    assert seqs_that_fit(CAMPAIGN, 80 * 10**9) >= 64  # twice the batch still passes


def test_the_refusal_says_the_estimate_the_memory_and_the_flag():
    line = refusal(replace(CAMPAIGN, seqs=100_000), 80 * 10**9, "the GPU's memory (total_memory)")
    need = sum(step_memory(replace(CAMPAIGN, seqs=100_000)).values())
    assert line.startswith(f"one training step needs at least {need / GIB:,.1f} GiB (the draft's logits "), line
    assert "100000 sequences x 64 blocks of 16 rows, 640 tokens each) but the GPU's memory (total_memory) " \
           "is 74.5 GiB: lower --seqs-per-batch (at most 104 fit with the rest as they are), " \
           f"--anchors-per-seq or --block-size; {ENV}=off skips this check" in line, line
    # a huge block: named first, no count of sequences when not even one fits
    line = refusal(replace(CAMPAIGN, block_size=100_000, seqs=2), 80 * 10**9, "x")
    assert line.endswith(f"lower --block-size, --anchors-per-seq or --seqs-per-batch; {ENV}=off skips "
                         "this check"), line


def test_check_step_memory_reads_the_override_and_off(monkeypatch):
    absurd = replace(CAMPAIGN, seqs=10**9)
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match=r"^one training step needs at least .* but this machine's "
                                         r"(available )?RAM is "):
        check_step_memory(absurd, mx)  # no machine has ~10^8 GiB
    monkeypatch.setenv(ENV, "off")
    check_step_memory(absurd, mx)
    monkeypatch.setenv(ENV, "1e12")  # a number of GiB replaces the measured memory
    check_step_memory(replace(CAMPAIGN, seqs=100_000), mx)
    monkeypatch.setenv(ENV, "0.5")
    with pytest.raises(ValueError, match=f"but {ENV} is 512.0 MiB:"):
        check_step_memory(CAMPAIGN, mx)
    for bad in ("abc", "-1", "0", "inf", "nan"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=f"^{ENV}='{bad}': expected a number of GiB above 0, or off$"):
            check_step_memory(TINY, mx)


# --- the command line: real processes, refused before the data ---------------------------------
SHAPE = ["--num-capture", "3", "--anchors-per-seq", "4", "--eval-prompts", "0", "--dtype", "float32",
         "--no-compile", "--log-every", "1", "--max-steps", "1"]
LIMIT = 6 << 30  # address space: the code before the fix dies here instead of taking the machine


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s48-no-config", "DFLASH_BLAS": "none",
            **extra}


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _dflash(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.engine.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=_env(**env), preexec_fn=_limit)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("s48mem")
    r = _dflash(d, "make-tiny", "q", "--arch", "qwen3")
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.parametrize("args, words", [
    (["--seqs-per-batch", "100000000", "--block-size", "8", "--max-len", "64"],
     r"100000000 sequences x 4 blocks of 8 rows, 32 tokens each at the least\) but this machine's "
     r"(available )?RAM is [\d,.]+ GiB: lower --seqs-per-batch \(at most \d+ fit with the rest as they are\), "
     r"--block-size or --anchors-per-seq; "),
    (["--seqs-per-batch", "2", "--block-size", "100000", "--max-len", "200000"],
     r"2 sequences x 4 blocks of 100000 rows, 32 tokens each at the least\) but this machine's "
     r"(available )?RAM is [\d,.]+ GiB: lower --block-size, --anchors-per-seq or --seqs-per-batch; "),
], ids=["seqs-per-batch", "block-size+max-len"])
def test_an_absurd_step_is_refused_in_one_line_before_the_data(root: Path, tmp_path: Path, args, words):
    """Before: MLX allocated until the process was killed (or the machine swapped)."""
    out = tmp_path / "out"
    r = _dflash(root, "train-draft", "--target", "q", "--out", out, *SHAPE, *args, "--num-prompts", "2",
                "--max-new-tokens", "4")
    line = _one_error(r)
    assert re.match(r"Error: one training step needs at least [\d,.]+ GiB \(the draft's ", line), line
    assert re.search(words + f"{ENV}=off skips this check$", line), line
    assert not out.exists()  # refused before the data cache or anything else was written


def test_the_override_refuses_before_the_data_and_again_with_the_datas_length(root: Path, tmp_path: Path):
    """DFLASH_TRAIN_MEMORY_GIB stands for the machine's memory. Below what 32-token sequences need:
    refused before the data; between that and what the data's longer sequences need: refused
    after the data is cached, before the first step. Before: both trained."""
    out = tmp_path / "out"
    shape = [*SHAPE, "--seqs-per-batch", "64", "--block-size", "8", "--max-len", "640"]
    data = ["--num-prompts", "4", "--max-new-tokens", "40", "--data-dir", tmp_path / "data"]
    r = _dflash(root, "train-draft", "--target", "q", "--out", out, *shape, *data, DFLASH_TRAIN_MEMORY_GIB="0.001")
    line = _one_error(r)
    floor = re.match(r"Error: one training step needs at least ([\d.]+) MiB .*64 sequences x 4 blocks of 8 rows, "
                     rf"32 tokens each at the least\) but {ENV} is 1\.0 MiB: lower --seqs-per-batch", line)
    assert floor, line
    assert not out.exists() and not (tmp_path / "data").exists()
    room = (float(floor.group(1)) + 0.5) / 1024  # GiB: 32 tokens fit, the data's longer ones do not
    r = _dflash(root, "train-draft", "--target", "q", "--out", out, *shape, *data, DFLASH_TRAIN_MEMORY_GIB=str(room))
    line = _one_error(r)
    seq_len = re.search(r"\[data\] \d+ training sequences, \d+ tokens, sequence length (\d+)", r.stderr)
    assert seq_len and int(seq_len.group(1)) > 32, r.stderr
    assert f"64 sequences x 4 blocks of 8 rows, {seq_len.group(1)} tokens each) but {ENV} is " in line, line
    assert "[train] step" not in r.stderr and not (out / "checkpoint").exists()
