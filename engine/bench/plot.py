"""Presenting a `dflash benchmark` result: the console summary table and the PNG plot.

Kept apart from the measuring code so matplotlib stays an optional dependency (extra `bench`):
without it the plot is skipped with a note and nothing else changes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

_COLUMNS = [
    # (header, summary key, format)
    ("context", "context", "{:d}"),
    ("base tok/s", "baseline_decode_tps", "{:.1f}"),
    ("dflash tok/s", "dflash_decode_tps", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("paired", "speedup_paired", "{:.2f}x"),
    ("accept", "acceptance", "{:.1%}"),
    ("tok/cycle", "tokens_per_cycle", "{:.2f}"),
    ("TTFT base ms", "baseline_ttft_s", "ms"),
    ("TTFT dflash ms", "dflash_ttft_s", "ms"),
    ("verify ms", "verify_ms", "{:.2f}"),
    ("revisited ms", "verify_revisited_ms", "{:.2f}"),
    ("step ms", "step_ms", "{:.2f}"),
    ("draft ms", "draft_ms", "{:.2f}"),
    ("verify/step", "ratio", "{:.2f}"),
    ("ideal", "ideal_speedup", "{:.2f}x"),
    ("of ideal", "fraction_of_ideal", "{:.0%}"),
    ("first-time", "first_time", "{}"),
    ("lossless", "lossless", "{}"),
]
_TEMP = ("temp", "temperature", "{:g}")


def _columns(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The temperature column only when a row is sampled."""
    if any(r.get("temperature") for r in result["summary"]):
        return [_COLUMNS[0], _TEMP, *_COLUMNS[1:]]
    return _COLUMNS


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    fwd = row.get("forward") or {}
    value = row[key] if key in row else fwd.get(key)
    if key == "first_time" and not value and row.get("dflash_first_time") and \
            row.get("revisited_widths") == [1]:
        return "dflash"  # --process-per-run: the baseline revisited single-token steps only
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1e3:.0f}"
    return fmt.format(value)


def format_table(result: dict[str, Any]) -> str:
    """A fixed-width table of the per-context summary (medians over repeats)."""
    columns = _columns(result)
    rows = [[_cell(r, key, fmt) for _, key, fmt in columns] for r in result["summary"]]
    heads = [h for h, _, _ in columns]
    if (result.get("config") or {}).get("chat"):  # two questions may share a prompt length
        heads = ["question", *heads]
        rows = [[label, *row] for label, row in zip(question_labels(result["summary"]), rows)]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    mode = "ORACLE (ceiling, not a real draft)" if result["mode"] == "oracle" else "dflash"
    title = (f"== summary: {result['model']} | mode {mode} | {result['dtype']} | "
             f"{result['hardware']['mx_default_device']} | medians of "
             f"{result['config']['repeats']} repeat(s)"
             + (f" | INTERRUPTED (Ctrl-C or SIGTERM): {len(rows)} finished row(s)" if result.get("interrupted") else ""))
    rule = line(["-" * w for w in widths])
    method = result.get("method") or {}
    note = (f"== method: first-time lengths {method.get('first_time_lengths')} (verified "
            f"{method.get('first_time_verified')}), warm-up {method.get('warmup_runs')}, "
            f"{method.get('repeats')} repeats, medians; MLX_CUDA_USE_CUDNN_SDPA="
            f"{(method.get('mlx_cuda_use_cudnn_sdpa') or {}).get('value')}, MLX_USE_CUDA_GRAPHS="
            f"{(method.get('mlx_use_cuda_graphs') or {}).get('value')}, verify attention "
            f"{method.get('verify_attention')}, pipelined {method.get('pipelined')}") if method else None
    return "\n".join([title, line(heads), rule] + [line(r) for r in rows] + ([note] if note else []))


def plot(result: dict[str, Any], path: Path) -> str:
    """Draw tok/s of both engines and acceptance against context (per question with --chat);
    return a one-line note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'dflash[bench]')"

    if not result["summary"]:  # a run interrupted before its first row finished
        return "skipped: no finished rows"
    if (result.get("config") or {}).get("chat"):
        return _plot_chat(result, path, plt)
    rows = result["summary"]
    ctx = sorted({r["context"] for r in rows})
    temps = list(dict.fromkeys(r.get("temperature", 0.0) for r in rows))
    oracle = result["mode"] == "oracle"
    dlabel = "DFlash ORACLE (ceiling)" if oracle else "DFlash"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax3 = ax2.twinx()
    for t in temps:
        sel = [r for r in rows if r.get("temperature", 0.0) == t]
        x = [r["context"] for r in sel]
        tag = "" if len(temps) == 1 and not t else f" (T={t:g})"
        ax1.plot(x, [r["baseline_decode_tps"] for r in sel], "o-", label="mlx-lm baseline" + tag)
        ax1.plot(x, [r["dflash_decode_tps"] for r in sel], "s-", label=dlabel + tag)
        for xx, r in zip(x, sel):
            ax1.annotate(f"{r['speedup']:.2f}x", (xx, r["dflash_decode_tps"]),
                         textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax2.plot(x, [r["acceptance"] for r in sel], "o-", label="acceptance" + tag)
        ax3.plot(x, [r["tokens_per_cycle"] for r in sel], "s--", label="tokens/cycle" + tag)
    top = max(max(r["dflash_decode_tps"], r["baseline_decode_tps"]) for r in rows)
    ax1.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s",
            ylim=(0, top * 1.15 or 1), title="Decode speed (median of repeats)")
    ax1.legend(fontsize=8)
    ax2.set(xscale="log", xlabel="context (tokens)", ylabel="acceptance", ylim=(0, 1.05),
            title="Acceptance and tokens per cycle")
    ax3.set(ylabel="tokens per cycle", ylim=(0, result["block_size"] + 1))
    for ax in (ax1, ax2):
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.minorticks_off()
    return _finish(fig, plt, ax2, ax3, "lower left", result,
                   "ORACLE mode" if oracle else "dflash mode", path)


def _plot_chat(result: dict[str, Any], path: Path, plt: Any) -> str:
    """--chat rows are questions, not contexts (two may share a prompt length): grouped bars per
    question, tok/s of both engines with the speedup above, acceptance and tokens per cycle."""
    rows = result["summary"]
    n = _questions(rows)
    labels = [q + (f"\nT={r.get('temperature', 0.0):g}" if n < len(rows) else "")
              for q, r in zip(question_labels(rows), rows)]
    x = list(range(len(rows)))
    speedups = [r["speedup"] for r in rows]
    geo = math.exp(sum(math.log(v) for v in speedups) / len(speedups))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.bar([i - 0.2 for i in x], [r["baseline_decode_tps"] for r in rows], 0.4, label="mlx-lm baseline")
    ax1.bar([i + 0.2 for i in x], [r["dflash_decode_tps"] for r in rows], 0.4, label="DFlash")
    for i, r in zip(x, rows):
        ax1.annotate(f"{r['speedup']:.2f}x", (i + 0.2, r["dflash_decode_tps"]),
                     textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    top = max(max(r["dflash_decode_tps"], r["baseline_decode_tps"]) for r in rows)
    ax1.set(ylabel="decode tokens/s", ylim=(0, top * 1.15 or 1),
            title=f"Decode speed per question (geometric mean {geo:.2f}x)")
    ax1.legend(fontsize=8)
    ax2.bar(x, [r["acceptance"] for r in rows], 0.5, label="acceptance")
    ax2.set(ylabel="acceptance", ylim=(0, 1.05), title="Acceptance and tokens per cycle")
    ax3 = ax2.twinx()
    ax3.plot(x, [r["tokens_per_cycle"] for r in rows], "s", color="tab:orange", label="tokens/cycle")
    ax3.set(ylabel="tokens per cycle", ylim=(0, result["block_size"] + 1))
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels)
    return _finish(fig, plt, ax2, ax3, "upper right", result, "chat questions", path)


def _finish(fig: Any, plt: Any, ax2: Any, ax3: Any, legend_at: str, result: dict[str, Any],
            what: str, path: Path) -> str:
    """One legend for the right panel's two axes, the title line, the file."""
    handles = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc=legend_at, fontsize=8)
    fig.suptitle(f"{result['model']} | {what} | {result['dtype']} | "
                 f"{result['hardware'].get('gpu') or result['hardware']['mx_default_device']}",
                 fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:  # disk full: the JSON beside it is written; no empty PNG, no traceback
        path.unlink(missing_ok=True)
        return f"not drawn: {path} cannot be written ({e.strerror or e})"
    finally:
        plt.close(fig)
    return str(path)


def question_labels(rows: list[dict[str, Any]]) -> list[str]:
    """"Q1".. per --chat row: the row's `question` index (0-based) where the result holds one,
    else its place among the rows of its temperature (results written before session 45)."""
    n = _questions(rows)
    return [f"Q{(r['question'] if isinstance(r.get('question'), int) else i % n) + 1}"
            for i, r in enumerate(rows)]


def _questions(rows: list[dict[str, Any]]) -> int:
    """Questions per temperature (--chat runs every question at each temperature in turn)."""
    temps = list(dict.fromkeys(r.get("temperature", 0.0) for r in rows))
    return max(1, len(rows) // len(temps))


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash.engine.bench.plot RESULT.json ...`: print each saved result's table and
    draw its plot again beside it (RESULT.png), e.g. after installing matplotlib."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m dflash.engine.bench.plot", description=main.__doc__)
    ap.add_argument("results", nargs="+", type=Path, help="JSON files written by dflash benchmark")
    a = ap.parse_args(argv)
    for f in a.results:
        try:
            result = json.loads(f.read_text())
        except OSError as e:
            print(f"{f}: cannot be read ({e.strerror or e})", file=sys.stderr)
            return 1
        except ValueError as e:
            print(f"{f}: not a dflash benchmark result (not JSON: {e})", file=sys.stderr)
            return 1
        try:
            print(format_table(result))
            print(f"== plot: {plot(result, f.with_suffix('.png'))}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"{f}: not a dflash benchmark result ({type(e).__name__}: {e})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
