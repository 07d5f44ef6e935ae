"""Presenting a `dflash benchmark` result: the console summary table and the PNG plot.

Kept apart from the measuring code so matplotlib stays an optional dependency (extra `bench`):
without it the plot is skipped with a note and nothing else changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLUMNS = [
    # (header, summary key, format)
    ("context", "context", "{:d}"),
    ("base tok/s", "baseline_decode_tps", "{:.1f}"),
    ("dflash tok/s", "dflash_decode_tps", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("accept", "acceptance", "{:.1%}"),
    ("tok/cycle", "tokens_per_cycle", "{:.2f}"),
    ("TTFT base ms", "baseline_ttft_s", "ms"),
    ("TTFT dflash ms", "dflash_ttft_s", "ms"),
    ("verify ms", "verify_ms", "{:.2f}"),
    ("step ms", "step_ms", "{:.2f}"),
    ("verify/step", "ratio", "{:.2f}"),
    ("lossless", "lossless", "{}"),
]


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    fwd = row.get("forward") or {}
    value = row.get(key, fwd.get(key))
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1e3:.0f}"
    return fmt.format(value)


def format_table(result: dict[str, Any]) -> str:
    """A fixed-width table of the per-context summary (medians over repeats)."""
    rows = [[_cell(r, key, fmt) for _, key, fmt in _COLUMNS] for r in result["summary"]]
    heads = [h for h, _, _ in _COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    mode = "ORACLE (ceiling, not a real draft)" if result["mode"] == "oracle" else "dflash"
    title = (f"== summary: {result['model']} | mode {mode} | {result['dtype']} | "
             f"{result['hardware']['mx_default_device']} | medians of "
             f"{result['config']['repeats']} repeat(s)")
    rule = line(["-" * w for w in widths])
    return "\n".join([title, line(heads), rule] + [line(r) for r in rows])


def plot(result: dict[str, Any], path: Path) -> str:
    """Draw tok/s of both engines and acceptance against context; return a one-line note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'dflash[bench]')"

    rows = result["summary"]
    ctx = [r["context"] for r in rows]
    oracle = result["mode"] == "oracle"
    dlabel = "DFlash ORACLE (ceiling)" if oracle else "DFlash"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(ctx, [r["baseline_decode_tps"] for r in rows], "o-", label="mlx-lm baseline")
    ax1.plot(ctx, [r["dflash_decode_tps"] for r in rows], "s-", label=dlabel)
    for x, r in zip(ctx, rows):
        ax1.annotate(f"{r['speedup']:.2f}x", (x, r["dflash_decode_tps"]),
                     textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    top = max(max(r["dflash_decode_tps"], r["baseline_decode_tps"]) for r in rows)
    ax1.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s",
            ylim=(0, top * 1.15 or 1), title="Decode speed (median of repeats)")
    ax1.legend()
    ax2.plot(ctx, [r["acceptance"] for r in rows], "o-", color="tab:green", label="acceptance")
    ax2.set(xscale="log", xlabel="context (tokens)", ylabel="acceptance", ylim=(0, 1.05),
            title="Acceptance and tokens per cycle")
    ax3 = ax2.twinx()
    ax3.plot(ctx, [r["tokens_per_cycle"] for r in rows], "s--", color="tab:purple",
             label="tokens/cycle")
    ax3.set(ylabel="tokens per cycle", ylim=(0, result["block_size"] + 1))
    handles = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc="lower left")
    for ax in (ax1, ax2):
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.minorticks_off()
    mode = "ORACLE mode" if oracle else "dflash mode"
    fig.suptitle(f"{result['model']} | {mode} | {result['dtype']} | "
                 f"{result['hardware'].get('gpu') or result['hardware']['mx_default_device']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
