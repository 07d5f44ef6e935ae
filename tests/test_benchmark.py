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

from dflash.engine.bench.cli import benchmark_command
from dflash.engine.bench.plot import format_table, plot
from dflash.engine.bench.run import run_benchmark
from dflash.engine.bench.setup import BenchConfig, prompt_ids
from dflash.engine.bench.timing import compare_ids
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
        # an attention-only target: each verify is timed again at the same shape, and the
        # repeat does not make the timed forwards' own shapes revisited
        assert fwd["verify_revisited_ms"] > 0 and fwd["first_time"] is True


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
    from dflash.engine.bench.setup import build_setup

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
    # the saved result drawn again (per question: bars, not a line over prompt lengths)
    from dflash.engine.bench import plot as plot_tool

    (saved,) = tmp_path.glob("*.json")
    assert plot_tool.main([str(saved)]) == 0
    png = saved.with_suffix(".png")
    assert png.is_file(), "no plot: the bench extra (matplotlib) is missing; `make` installs it"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    two_temps = [dict(r, temperature=t) for t in (0.0, 0.7) for r in data["summary"]]
    assert plot_tool._questions(two_temps) == 2 and plot_tool._questions(data["summary"]) == 2
    assert plot_tool.main([str(questions)]) == 1  # not a result: a clear line, no traceback
    with pytest.raises(ValueError, match="--chat needs a real model"):
        run_benchmark(BenchConfig(random_target="tiny", chat=True, out=str(tmp_path)), log=lambda s: None)


def test_chat_process_per_run_is_first_time(tiny: Path, tmp_path: Path) -> None:
    """--chat --process-per-run: each repeat of each question in a process of its own, warmed up
    on text elsewhere, DFlash first: every DFlash run decodes at shapes new to its process (the
    ledger says so), the baseline after it revisits at most single-token steps, and the parent
    writes one result with a row per question over all repeats."""
    questions = tmp_path / "q.txt"
    questions.write_text("What is two plus two?\nName a red fruit.\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(benchmark_command, [
        "--model", str(tiny / "target"), "--draft", str(tiny / "draft"), "--chat", "--prompt-file",
        str(questions), "--process-per-run", "--repeats", "2", "--max-tokens", str(MAX_TOKENS),
        "--cooldown", "0", "--verify-iters", "2", "--no-plot", "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    (saved,) = out.glob("*.json")
    data = json.loads(saved.read_text())
    m = data["method"]
    assert m["process_per_run"] is True and m["processes"] == 4 and m["repeats"] == 2
    assert m["warmup_context"] == 2 * MAX_TOKENS + 512 and m["first_time_verified"] is True
    assert set(m["revisited_widths"]) <= {1} and data["lossless"] is True
    assert [row["question"] for row in data["summary"]] == [0, 1]
    for row in data["summary"]:
        assert row["dflash_first_time"] is True and row["lossless"] is True
        assert len(row["baseline_runs_tps"]) == len(row["dflash_runs_tps"]) == 2
    runs = data["runs"]
    assert sorted((r["question"], r["repeat"], r["engine"]) for r in runs) == sorted(
        (q, r, e) for q in (0, 1) for r in (0, 1) for e in ("baseline", "dflash"))
    assert all(r["first_time"] for r in runs if r["engine"] == "dflash")
    # a child that fails is a clear error of the command, not a traceback
    res = CliRunner().invoke(benchmark_command, [
        "--model", str(tmp_path / "missing"), "--draft", str(tiny / "draft"), "--chat",
        "--process-per-run", "--prompt-file", str(questions), "--out", str(tmp_path / "bad")])
    assert res.exit_code == 1 and "exited with status" in res.output, res.output
    for args, msg in ((["--process-per-run"], "is for --chat"),
                      (["--warmup-context", "100"], "--warmup-context is for")):
        res = CliRunner().invoke(benchmark_command, ["--model", str(tiny / "target"), *args,
                                                     "--out", str(tmp_path / "refused")])
        assert res.exit_code == 1 and msg in res.output, res.output


def test_a_process_per_run_benchmark_stopped_by_timeout_keeps_its_finished_processes(
        tiny: Path, tmp_path: Path) -> None:
    """Session 39: `timeout 540` sent SIGTERM to a 15-process --process-per-run benchmark in its
    last process and the 14 finished ones were lost. Now SIGTERM to the whole process group, as
    `timeout` sends it, stops it as Ctrl-C does: exit 130, one JSON with the finished
    processes' runs and `interrupted: true`."""
    import os
    import signal
    import subprocess

    questions = tmp_path / "q.txt"
    questions.write_text("What is two plus two?\nName a red fruit.\n")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.engine.bench", "--model", str(tiny / "target"),
         "--draft", str(tiny / "draft"), "--chat", "--prompt-file", str(questions),
         "--process-per-run", "--repeats", "2", "--max-tokens", str(MAX_TOKENS), "--cooldown", "0",
         "--verify-iters", "0", "--no-plot", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **NO_REEXEC},
        start_new_session=True)  # a process group of its own, as `timeout` makes
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("== process 2/4"):  # the first process has finished
            os.killpg(proc.pid, signal.SIGTERM)
            break
    out_text, err = proc.communicate(timeout=120)
    output = "".join(lines) + out_text
    assert proc.returncode == 130 and "Traceback" not in err, output + err
    assert "== stopped: 1 of 4 process(es) finished" in output, output
    (saved,) = out.glob("*.json")
    data = json.loads(saved.read_text())
    assert data["interrupted"] is True and data["method"]["process_per_run"] is True
    assert {(r["question"], r["repeat"]) for r in data["runs"]} == {(0, 0)}
    assert {r["engine"] for r in data["runs"]} == {"baseline", "dflash"}


def test_chat_prompt_file_takes_the_held_out_sets_jsonl() -> None:
    """--chat --prompt-file: plain lines or the held-out sets' JSONL (engine/prompting.py, the one
    parser the trainer's prompt files use too); a bad JSON line names its line."""
    from dflash.engine.prompting import prompt_lines
    from dflash.engine.training.data import HELDOUT_FILE, load_heldout

    held = HELDOUT_FILE.read_text()
    assert [q for _, q in prompt_lines(held)] == [p for _, p in load_heldout()] and len(load_heldout()) == 48
    assert prompt_lines('Plain one?\n\n{"prompt": "Json one?", "kind": "chat"}\n') == [
        ("file", "Plain one?"), ("chat", "Json one?")]
    for bad in ('{"kind": "chat"}', '{"prompt": 1', "{not json}"):
        with pytest.raises(ValueError, match="prompt file line 2"):
            prompt_lines("fine\n" + bad)


# --- first-time lengths, the method, sampling ---------------------------------------------------
def test_every_timed_run_decodes_at_first_time_shapes(tiny: Path, tmp_path: Path) -> None:
    cfg = BenchConfig(model=str(tiny / "target"), draft=str(tiny / "draft"), contexts=CONTEXTS,
                      max_tokens=MAX_TOKENS, repeats=2, cooldown=0, verify_iters=2,
                      out=str(tmp_path), plot=False)
    data, _ = run_benchmark(cfg, log=lambda s: None)
    m = data["method"]
    assert m["first_time_lengths"] is True and m["first_time_verified"] is True
    assert m["revisited_runs"] == 0 and m["warmup_runs"] == 1 and m["repeats"] == 2
    assert m["short_block_max"] == 0  # the tiny draft was not trained on cut blocks
    assert m["mlx_cuda_use_cudnn_sdpa"]["value"] is not None or sys.platform == "darwin"
    prompts = [(r["engine"], r["prompt_tokens"]) for r in data["runs"]]
    assert len(set(prompts)) == len(prompts)  # every run its own prompt length
    for run in data["runs"]:
        assert run["first_time"] is True and run["shapes"]["revisited_shapes"] == 0
        assert run["lossless"] is True if run["engine"] == "dflash" else "lossless" not in run
    for row in data["summary"]:
        assert row["first_time"] is True and row["forward"]["first_time"] is True
        assert row["forward"]["draft_ms"] > 0
        ideal = row["tokens_per_cycle"] * row["forward"]["step_ms"] / (
            row["forward"]["verify_ms"] + row["forward"]["draft_ms"])
        assert row["ideal_speedup"] == pytest.approx(ideal)
        assert row["fraction_of_ideal"] == pytest.approx(row["speedup"] / ideal)
        assert len(row["baseline_runs_tps"]) == len(row["dflash_runs_tps"]) == 2


def test_same_prompt_method_reports_its_revisits(tiny: Path, tmp_path: Path) -> None:
    cfg = BenchConfig(model=str(tiny / "target"), draft=str(tiny / "draft"), contexts=[64],
                      max_tokens=MAX_TOKENS, repeats=2, cooldown=0, verify_iters=0,
                      first_time_lengths=False, out=str(tmp_path), plot=False)
    data, _ = run_benchmark(cfg, log=lambda s: None)
    assert data["method"]["first_time_lengths"] is False
    assert data["method"]["first_time_verified"] is False  # the warm-up ran the same prompt
    assert all(r["prompt_tokens"] == 64 and r["first_time"] is False for r in data["runs"])
    assert data["summary"][0]["forward"] is None and data["lossless"] is True


def test_oracle_on_a_decisive_random_target_takes_every_block(tmp_path: Path) -> None:
    cfg = BenchConfig(random_target="tiny", oracle=True, draft_layers=1, contexts=[64],
                      max_tokens=MAX_TOKENS + 1, repeats=3, cooldown=0, verify_iters=2,
                      out=str(tmp_path), plot=False, dtype="bfloat16")
    data, _ = run_benchmark(cfg, log=lambda s: None)
    assert data["method"]["decisive_random_target"] is True and data["method"]["first_time_verified"]
    dfl = [r for r in data["runs"] if r["engine"] == "dflash"]
    assert len({r["prompt_tokens"] for r in dfl}) == 3  # the reference prompt + j of its ids
    assert all(r["tokens_per_cycle"] == BLOCK and r["lossless"] for r in dfl)
    assert data["summary"][0]["oracle_reference"]["every_draft_accepted"] is True


def test_sampling_side_by_side(tiny: Path, tmp_path: Path) -> None:
    output, data = _invoke(["--model", str(tiny / "target"), "--draft", str(tiny / "draft"),
                            "--temperature", "0,0.7", "--top-k", "20", "--min-p", "0.05",
                            "--min-tokens-to-keep", "3", "--seed", "3"], tmp_path)
    assert [(r["context"], r["temperature"]) for r in data["summary"]] == [
        (c, t) for t in (0.0, 0.7) for c in CONTEXTS]
    sampled = [r for r in data["runs"] if r["temperature"] == 0.7]
    assert sampled and all(isinstance(r["seed"], int) for r in sampled)
    assert len({r["seed"] for r in sampled}) == len(sampled)
    assert all(r["lossless"] is None for r in sampled if r["engine"] == "dflash")
    assert all(r["generated_tokens"] == MAX_TOKENS for r in sampled)
    assert data["lossless"] is True and "lossless: null" in data["lossless_note"]
    for row in data["summary"]:
        assert row["lossless"] is (None if row["temperature"] else True)
        assert row["acceptance"] >= 0 and row["tokens_per_cycle"] >= 1
    assert data["config"]["temperatures"] == [0.0, 0.7] and data["config"]["top_k"] == 20
    assert (data["config"]["min_p"], data["config"]["min_tokens_to_keep"]) == (0.05, 3)
    assert "temp" in output
    with pytest.raises(ValueError, match="greedy only"):
        run_benchmark(BenchConfig(model=str(tiny / "target"), oracle=True, temperatures=[0.5],
                                  out=str(tmp_path)), log=lambda s: None)


def test_ledger_and_planner() -> None:
    from dflash.engine.bench.plan import (
        Planner, ShapeLedger, baseline_shapes, dflash_shapes, oracle_shapes)

    ledger = ShapeLedger()
    ledger.begin()
    for o in range(90, 100):
        ledger.record(512, 0) if o == 90 else None
        ledger.record(1, o)
    info = ledger.end(prompt_len=95)
    assert info["first_time"] and info["decode_forwards"] == 5 and info["cache_lengths"] == [95, 100]
    ledger.begin()
    ledger.record(1, 97)
    assert ledger.end(prompt_len=97)["revisited_shapes"] == 1
    planner = Planner(ledger)
    # a baseline of 10 tokens cannot touch offsets 90..99 again: nearest fresh lengths are outside
    assert planner.nearest(95, lambda n: baseline_shapes(n, 10)) == 100
    assert planner.nearest(80, lambda n: baseline_shapes(n, 9)) == 80
    # M=16 verifies step by the block: another residue is new even inside a visited range
    ledger.begin()
    for k in range(3):
        ledger.record(16, 200 + 16 * k)
    ledger.end(prompt_len=200)
    assert planner.nearest(200, lambda n: oracle_shapes(n, 32, 16), candidates=range(200, 205)) == 201
    assert not planner.fresh(dflash_shapes(199, 32, 16))


# --- the command line as a user meets it --------------------------------------------------------
NO_REEXEC = {"DFLASH_BLAS": "none"}  # in this process: never the re-exec that preloads a BLAS (accel.py)
QUICK = ["--contexts", "64", "--max-tokens", "8", "--repeats", "1", "--cooldown", "0",
         "--verify-iters", "1", "--no-plot"]


def _bench(args: list[str]) -> tuple[int, str]:
    res = CliRunner(env=NO_REEXEC).invoke(benchmark_command, args)
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    return res.exit_code, res.output


def test_default_out_is_under_the_current_directory(tiny: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Not benchmark/results, the repository's archive: a user's run lands where they ran it."""
    assert BenchConfig().out == "benchmark-results"
    monkeypatch.chdir(tmp_path)
    code, output = _bench(["--model", str(tiny / "target"), "--draft", str(tiny / "draft"),
                           "--label", "cwd", *QUICK])
    assert code == 0, output
    (saved,) = (tmp_path / "benchmark-results").glob("cwd-*.json")
    assert f"== results: benchmark-results/{saved.name}" in output
    assert not (tmp_path / "benchmark").exists()


def test_bad_out_is_refused_before_the_runs(tiny: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "results.txt"
    a_file.write_text("mine")
    pair = ["--model", str(tiny / "target"), "--draft", str(tiny / "draft")]
    for out, says in ((a_file, "exists and is not a folder"), (a_file / "sub", "cannot be made")):
        code, output = _bench([*pair, *QUICK, "--out", str(out)])
        assert code == 1 and says in output and "== dflash benchmark" not in output, output
    assert a_file.read_text() == "mine"
    # a failure before anything is written leaves no folder made for it behind
    code, output = _bench([*pair, *QUICK, "--verify-window", "17", "--out", str(tmp_path / "new" / "deep")])
    assert code == 1 and "larger than this draft's block" in output
    assert "-- context" not in output  # refused before the first run, not after a warm-up
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, says", [
    (["--verify-window", "0"], "Invalid value for '--verify-window'"),
    (["--verify-window", "wide"], "Invalid value for '--verify-window'"),
    (["--cooldown", "inf"], "Invalid value for '--cooldown'"),
    (["--cooldown", "nan"], "Invalid value for '--cooldown'"),
    (["--top-p", "nan"], "Invalid value for '--top-p'"),
    (["--seed", "-1"], "Invalid value for '--seed'"),
    (["--model", "x"], "give it without --model / --draft"),
])
def test_bad_values_are_usage_errors(args: list[str], says: str, tmp_path: Path) -> None:
    code, output = _bench(["--random-target", "tiny", *QUICK, "--out", str(tmp_path), *args])
    assert code == 2 and says in output, output
    assert not list(tmp_path.iterdir())


def test_no_draft_is_refused_before_any_run(tmp_path: Path) -> None:
    code, output = _bench(["--random-target", "tiny", "--draft-layers", "0", *QUICK, "--out", str(tmp_path)])
    assert code == 1 and "needs a draft" in output and "== dflash benchmark" not in output


def test_empty_prompt_file_is_refused_not_replaced(tiny: Path, tmp_path: Path) -> None:
    """An empty --prompt-file used to run the built-in prose (or the built-in chat questions)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    pair = ["--model", str(tiny / "target"), "--draft", str(tiny / "draft"), *QUICK, "--out", str(tmp_path / "r")]
    for args, says in ((["--prompt-file", str(empty)], "is empty"),
                       (["--prompt-file", str(empty), "--chat"], "is empty"),
                       (["--prompt-file", str(blank), "--chat"], "is empty")):
        code, output = _bench([*pair, *args])
        assert code == 1 and says in output and "== dflash benchmark" not in output, output
    assert not (tmp_path / "r").exists()


def test_oracle_draft_without_a_config_is_named(tiny: Path, tmp_path: Path) -> None:
    """--oracle --no-oracle-draft-cost reads only the draft's config: a wrong path says so as
    every other draft path does, not as a bare errno line."""
    code, output = _bench(["--model", str(tiny / "target"), "--oracle", "--no-oracle-draft-cost",
                           "--draft", str(tmp_path / "nope"), *QUICK, "--out", str(tmp_path / "r")])
    assert code == 1 and f"draft directory not found: {tmp_path / 'nope'}" in output, output


def test_random_draft_follows_the_seed() -> None:
    """--seed says it sets the random weights: the draft's too (seed 0: the draft of before)."""
    from mlx.utils import tree_flatten

    from dflash.engine.bench.setup import build_setup

    def draft_weights(seed: int) -> list:
        setup = build_setup(BenchConfig(random_target="tiny", draft_layers=1, seed=seed))
        return [w.tolist() for _, w in tree_flatten(setup.draft_model.parameters()) if w.ndim > 1][:1]

    assert draft_weights(0) != draft_weights(1)


def test_results_never_overwrite_each_other(tmp_path: Path) -> None:
    """Two results of one label in one second (tiny runs take about that) get two files."""
    from dflash.engine.bench.results import _write

    cfg = BenchConfig(label="same", out=str(tmp_path))
    paths = [_write({"n": i}, cfg, None) for i in range(3)]
    assert len(set(paths)) == 3
    assert [json.loads(p.read_text())["n"] for p in paths] == [0, 1, 2]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_writes_what_was_measured(tiny: Path, tmp_path: Path, sig: str) -> None:
    """A real process, a real SIGINT (Ctrl-C) or SIGTERM (`timeout`, `kill`) after its first
    timed run: exit 130, the JSON written with that run in it and `interrupted: true`, its path
    printed; bench.plot takes the file."""
    import os
    import signal
    import subprocess

    from dflash.engine.bench import plot as plot_tool

    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.engine.bench", "--model", str(tiny / "target"),
         "--draft", str(tiny / "draft"), "--contexts", "64,128,256", "--max-tokens", "64",
         "--repeats", "3", "--cooldown", "1", "--no-plot", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **NO_REEXEC},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background run ignores it
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "repeat 1/3" in line:  # a timed run has finished
            proc.send_signal(getattr(signal, sig))
            break
    out, err = proc.communicate(timeout=120)
    output = "".join(lines) + out
    assert proc.returncode == 130 and "Traceback" not in err, output + err
    (saved,) = tmp_path.glob("*.json")
    assert f"== results: {saved}" in output
    data = json.loads(saved.read_text())
    assert data["interrupted"] is True and data["runs"]
    assert all(r["context"] == 64 for r in data["runs"]) and len(data["summary"]) == 0
    assert all(r["lossless"] is None for r in data["runs"] if r["engine"] == "dflash")
    assert plot_tool.main([str(saved)]) == 0
