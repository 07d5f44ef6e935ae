"""`dflash benchmark` on tiny random models: the JSON's shape, losslessness, oracle arithmetic.

No timing thresholds: this machine is shared and slow; only structure and exact counts are
checked. Each benchmark here runs in a few seconds.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.benchmark import (
    BenchConfig,
    benchmark_command,
    compare_ids,
    prompt_ids,
    run_benchmark,
)
from dflash.engine.benchplot import format_table, plot
from dflash.engine.tiny import build_draft, build_target

BLOCK = 16
MAX_TOKENS = 32
CONTEXTS = [64, 128]

RUN_FIELDS = {
    "context", "repeat", "engine", "mode", "prompt_tokens", "generated_tokens", "ttft_s",
    "prefill_tps", "decode_tps", "e2e_tps", "total_s", "peak_memory_gb", "token_ids_sha1",
}
DFLASH_FIELDS = {
    "acceptance", "tokens_per_cycle", "cycles", "accept_histogram", "lossless", "first_mismatch",
}
SUMMARY_FIELDS = {
    "context", "baseline_decode_tps", "dflash_decode_tps", "speedup", "acceptance",
    "tokens_per_cycle", "accept_histogram", "baseline_ttft_s", "dflash_ttft_s", "lossless",
    "forward",
}


def oracle_counts(n_tokens: int, block: int) -> tuple[int, int]:
    """(cycles, accepted drafts) when every proposal inside the reference is accepted.

    The first token comes from prefill; each cycle proposes block-1 ids after its anchor and
    commits accepted + 1. Valid only when no proposal reaches past the reference (checked).
    """
    produced, cycles, accepted = 1, 0, 0
    while produced < n_tokens:
        cycles += 1
        last_proposed = produced + block - 2  # index into the reference
        assert last_proposed < n_tokens, "choose n_tokens so proposals stay inside the reference"
        accepted += block - 1
        produced += block
    return cycles, accepted


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    build_target(root / "target", "qwen3")
    build_draft(root / "draft", root / "target", num_layers=1, block_size=BLOCK)
    return root


def _invoke(args: list[str], out: Path) -> tuple[str, dict]:
    common = ["--contexts", ",".join(map(str, CONTEXTS)), "--max-tokens", str(MAX_TOKENS),
              "--repeats", "1", "--cooldown", "0", "--verify-iters", "2", "--no-plot",
              "--out", str(out)]
    res = CliRunner().invoke(benchmark_command, [*args, *common])
    assert res.exit_code == 0, res.output + repr(res.exception)
    files = list(out.glob("*.json"))
    assert len(files) == 1
    return res.output, json.loads(files[0].read_text())


def _check_common(data: dict, mode: str) -> None:
    assert data["mode"] == mode
    for key in ("hardware", "versions", "config", "runs", "summary", "block_size", "lossless"):
        assert key in data
    for key in ("platform", "processor", "cpu_count", "memory_gb", "mx_default_device"):
        assert key in data["hardware"]
    for key in ("mlx", "mlx_lm", "dflash", "python"):
        assert key in data["versions"]
    assert data["config"]["contexts"] == CONTEXTS
    assert data["config"]["oracle"] == (mode == "oracle")
    assert len(data["runs"]) == 2 * len(CONTEXTS)  # one baseline + one DFlash run per context
    for run in data["runs"]:
        assert RUN_FIELDS <= set(run)
        assert run["generated_tokens"] == MAX_TOKENS  # EOS ignored: fixed lengths
        if run["engine"] == "dflash":
            assert DFLASH_FIELDS <= set(run)
            assert run["mode"] == mode
            assert run["lossless"] is True
            assert sum(run["accept_histogram"]) == run["cycles"]
    assert data["lossless"] is True
    assert [row["context"] for row in data["summary"]] == CONTEXTS
    for row in data["summary"]:
        assert SUMMARY_FIELDS <= set(row)
        assert row["lossless"] is True
        assert math.isfinite(row["speedup"]) and row["speedup"] > 0
        fwd = row["forward"]
        assert fwd["block_size"] == BLOCK and fwd["step_ms"] > 0 and fwd["verify_ms"] > 0
        assert fwd["ratio"] == pytest.approx(fwd["verify_ms"] / fwd["step_ms"])


def test_dflash_mode(tiny: Path, tmp_path: Path) -> None:
    output, data = _invoke(
        ["--model", str(tiny / "target"), "--draft", str(tiny / "draft"), "--label", "t"],
        tmp_path,
    )
    _check_common(data, "dflash")
    assert "ORACLE" not in output
    assert "context" in output and "speedup" in output  # progress lines and summary table
    assert next(tmp_path.glob("*.json")).name.startswith("t-dflash-")


def test_oracle_mode_hits_the_block_size(tiny: Path, tmp_path: Path) -> None:
    output, data = _invoke(["--model", str(tiny / "target"), "--oracle"], tmp_path)
    _check_common(data, "oracle")
    assert "ORACLE" in output and "ORACLE" in data["mode_description"]
    cycles, accepted = oracle_counts(MAX_TOKENS, BLOCK)
    assert (accepted + cycles) / cycles == BLOCK  # 32 tokens: 1 from prefill + 2 full blocks
    for run in (r for r in data["runs"] if r["engine"] == "dflash"):
        assert run["cycles"] == cycles
        assert run["tokens_per_cycle"] == pytest.approx((accepted + cycles) / cycles)
        assert run["acceptance"] == pytest.approx(accepted / MAX_TOKENS)
        assert run["accept_histogram"][BLOCK - 1] == cycles
    for row in data["summary"]:
        assert row["oracle_reference"]["matches_baseline"] is True


def test_random_tiny_target_oracle_with_draft_cost(tmp_path: Path) -> None:
    cfg = BenchConfig(
        random_target="tiny", oracle=True, draft_layers=2, contexts=CONTEXTS,
        max_tokens=MAX_TOKENS, repeats=1, cooldown=0, verify_iters=2, out=str(tmp_path),
        plot=False,
    )
    lines: list[str] = []
    data, path = run_benchmark(cfg, log=lines.append)
    assert path.exists() and json.loads(path.read_text())["mode"] == "oracle"
    _check_common(data, "oracle")
    assert "draft still runs" in data["mode_description"]
    assert all(r["tokens_per_cycle"] == BLOCK for r in data["runs"] if r["engine"] == "dflash")
    assert "summary" in format_table(data)


def test_prompt_ids_exact_length(tiny: Path) -> None:
    from dflash.engine.benchmark import build_setup

    setup = build_setup(BenchConfig(model=str(tiny / "target"), oracle=True))
    for n in (1, 7, 300):
        ids = prompt_ids(setup, n, None, seed=0)
        assert len(ids) == n and all(0 <= i < setup.target.vocab_size for i in ids)


def test_compare_ids() -> None:
    assert compare_ids([1, 2, 3], [1, 2, 3]) == {"lossless": True, "first_mismatch": None}
    assert compare_ids([1, 5, 3], [1, 2, 3]) == {"lossless": False, "first_mismatch": 1}
    assert compare_ids([1, 2], [1, 2, 3]) == {"lossless": False, "first_mismatch": 2}


def test_plot_is_optional(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    note = plot({"summary": [], "mode": "dflash"}, tmp_path / "x.png")
    assert note.startswith("skipped") and "matplotlib" in note
    assert not (tmp_path / "x.png").exists()


def test_registered_in_cli() -> None:
    from dflash.engine.cli import main

    assert main.commands["benchmark"] is benchmark_command


def test_chat_mode_one_row_per_question(tiny: Path, tmp_path: Path) -> None:
    questions = tmp_path / "q.txt"
    questions.write_text("What is two plus two?\n\nName a red fruit.\n")
    _, data = _invoke(["--model", str(tiny / "target"), "--draft", str(tiny / "draft"), "--chat",
                       "--prompt-file", str(questions)], tmp_path)
    assert data["config"]["chat"] is True and len(data["summary"]) == 2
    assert all(row["lossless"] is True for row in data["summary"])
    with pytest.raises(ValueError, match="--chat needs a real model"):
        run_benchmark(BenchConfig(random_target="tiny", chat=True, out=str(tmp_path)), log=lambda s: None)
