"""Held-out evaluation with the real decoding loop, and the model card."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..draft import DFlashDraft
from ..target import TargetModel
from .objective import default_gamma

Log = Callable[[str], None]


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during `evaluate`: `report` covers the prompts that finished (the one
    in flight is left out whole), so an evaluation stopped by `timeout` keeps them."""

    def __init__(self, report: dict[str, Any]):
        super().__init__("held-out evaluation stopped")
        self.report = report

    @property
    def done(self) -> int:
        """How many prompts finished (the report's own count)."""
        return self.report.get("overall", {}).get("prompts", 0)


def evaluate(
    target: TargetModel, draft: DFlashDraft, tokenizer: Any, samples: list[Any],
    max_tokens: int = 128, log: Log = print, vocab: list[int] | None = None,
    window: str | int = "full", answers: list[dict[str, Any]] | None = None, rows: int = 1,
) -> dict[str, Any]:
    """Acceptance, tokens per cycle (tau) and the per-position acceptance curve of `draft`,
    overall and per prompt kind, decoding every prompt with the full 16-token verify
    (`vocab`: the ids the draft may propose, draftvocab.choose; None: all). A fixed `window`
    of k tokens instead measures what a short verify gets, from blocks cut to k rows where the
    draft's config allows it (engine/drafters.py; DFLASH_SHORT_BLOCK overrides): what cut-block
    training (`--short-block-frac`) is for.

    One draft row a verify by default (`rows`): what the draft itself proposes. A CUDA GPU's
    engine verifies 8 rows in bf16 (engine/branches.py), which buys more tokens a cycle from the
    same draft (session 36, an H100, bundled draft, bf16, 256 tokens: tau 4.37 with the default
    8 rows against 3.35 with one), so a held-out number that took the engine's default would
    move with the machine and dtype, not with the draft.

    curve[k-1] = share of cycles whose first k drafts were all accepted (k = 1..B-1).
    Overall also `by_position`: tau of the cycles that start in each 16-token stretch of the
    answer (where in an answer the draft is weak); each answer's last cycle, cut short by EOS or
    max_tokens, is left out of it.

    `answers`, when given, gets one record a prompt (kind, tau, the answer's token ids): which
    prompts pull tau up or down, and what the target wrote in this dtype (fp32 and bf16 greedy
    answers are different texts, which is what an fp32-vs-bf16 evaluation compares).

    Ctrl-C (or SIGTERM under `launch.stops_once`) raises EvalInterrupted with the report of
    the prompts that finished.
    """
    import time

    from ..drafters import DFlashDrafter

    drafter = DFlashDrafter(draft, target, vocab)
    sums: dict[str, dict[str, Any]] = {}
    by_pos: dict[int, list[int]] = {}  # 16-token stretch -> [cycles, accepted drafts]
    every, t0 = max(1, len(samples) // 8), time.perf_counter()  # progress: ~8 lines, not silence
    try:
        for n_done, s in enumerate(samples, 1):
            _one_prompt(target, drafter, tokenizer, s, max_tokens, window, rows, sums, by_pos, answers)
            if n_done % every == 0 and n_done < len(samples):
                o = sums["overall"]
                log(f"[eval] {n_done}/{len(samples)} prompts | acceptance so far "
                    f"{o['acc'] / max(o['gen'], 1):.1%} | {time.perf_counter() - t0:.0f}s")
    except KeyboardInterrupt:
        done = sums.get("overall", {}).get("n", 0)
        log(f"[eval] stopped after {done} of {len(samples)} prompts: the report covers those")
        raise EvalInterrupted(_report(sums, by_pos, log)) from None
    return _report(sums, by_pos, log)


def _one_prompt(target: TargetModel, drafter: Any, tokenizer: Any, s: Any, max_tokens: int,
                window: str | int, rows: int, sums: dict[str, dict[str, Any]],
                by_pos: dict[int, list[int]], answers: list[dict[str, Any]] | None) -> None:
    """Decode one prompt and add its counts to `sums` and `by_pos` only once it has finished
    (a stopped evaluation then reports whole prompts)."""
    from ..generate import Finished, TokenDelta, stream_dflash_generate

    final = None
    mine: dict[int, list[int]] = {}
    pos, last = 0, None  # answer tokens before `last`, the latest cycle's delta
    for i, ev in enumerate(stream_dflash_generate(
        target, drafter, tokenizer, s.prompt_ids, max_tokens, verify_window=window,
        copy_draft=False, branches=rows,
    )):
        if isinstance(ev, Finished):
            final = ev
        elif isinstance(ev, TokenDelta) and ev.token_ids:  # one per cycle: no stop strings
            if last is not None:  # a whole cycle: the next one came
                b = mine.setdefault(pos // 16, [0, 0])
                b[0] += 1
                b[1] += sum(last.from_draft)
                pos += len(last.token_ids)
            elif i == 0:  # the first token, from the prefill: not a cycle
                pos = len(ev.token_ids)
                continue
            last = ev
    for k, (c, a) in mine.items():
        b = by_pos.setdefault(k, [0, 0])
        b[0] += c
        b[1] += a
    st = final.stats
    if answers is not None:
        answers.append({"kind": s.kind, "tau": round(st.tokens_per_cycle, 3),
                        "cycles": st.cycles, "rows": st.branch_rows, "ids": list(final.token_ids)})
    for key in (s.kind, "overall"):
        acc = sums.setdefault(key, {"n": 0, "gen": 0, "acc": 0, "cyc": 0, "hist": None})
        acc["n"] += 1
        acc["gen"] += st.generated_tokens
        acc["acc"] += st.accepted_drafts
        acc["cyc"] += st.cycles
        h = list(st.accept_histogram or [])
        acc["hist"] = h if acc["hist"] is None else [a + b for a, b in zip(acc["hist"], h)]


def _report(sums: dict[str, dict[str, Any]], by_pos: dict[int, list[int]], log: Log) -> dict[str, Any]:
    """The counts as `evaluate` returns them (per kind and overall), each kind's line logged."""
    report = {}
    for k, v in sums.items():
        hist = v["hist"] or []
        cycles = max(sum(hist), 1)
        curve = [sum(hist[j:]) / cycles for j in range(1, len(hist))]
        report[k] = {"prompts": v["n"], "generated_tokens": v["gen"],
                     "acceptance": v["acc"] / max(v["gen"], 1),
                     "tau": (v["acc"] + v["cyc"]) / max(v["cyc"], 1), "cycles": v["cyc"],
                     "accept_curve": [round(c, 4) for c in curve]}
    if "overall" in report:
        report["overall"]["by_position"] = [
            {"from": 16 * i, "cycles": c, "tau": round(1 + a / c, 3)} for i, (c, a) in sorted(by_pos.items())]
    for k, r in sorted(report.items()):
        head = " ".join(f"{c:.2f}" for c in r["accept_curve"][:8])
        log(f"[eval] {k:8s} {r['prompts']:3d} prompts | acceptance {r['acceptance']:.1%} | "
            f"tau {r['tau']:.2f} tokens/cycle | P(accept >= k), k=1..: {head}")
    if report.get("overall", {}).get("by_position"):
        log("[eval] tau by answer position: " + ", ".join(
            f"{b['from']}+: {b['tau']:.2f}" for b in report["overall"]["by_position"]))
    return report


def _prompt_sources(o: dict[str, Any], derived: int | None) -> str:
    """Where the training prompts came from, in words (session 36's card said "built-in prompt
    set" for a run given --num-prompts 0, which trained on derived prompts only)."""
    parts = []
    if o.get("prompts"):
        parts.append(f"file {o['prompts']}")
    elif o.get("num_prompts") != 0:  # an older summary without the count: built-in ones still
        n = o.get("num_prompts")
        parts.append(f"{'' if n is None else f'{n} '}built-in prompts: chat, code, math, story, explain")
    if derived:
        parts.append(f"{derived} prompts written by the target itself (sampled user turns)")
    return " + ".join(parts) or "no prompts"


def write_model_card(out: Path, s: dict[str, Any]) -> None:
    """README.md next to the draft: what it is, how it was trained, what it achieves."""
    c = s["config"]
    rows = "\n".join(
        f"| {k} | {r['prompts']} | {r['acceptance']:.1%} | {r['tau']:.2f} | "
        f"{' '.join(f'{x:.2f}' for x in r.get('accept_curve', [])[:6])} |"
        for k, r in sorted(s["heldout"].items())
    )
    o = s["options"]
    f = s.get("final") or {}
    sched = s.get("schedule") or {}
    text = f"""# DFlash draft for `{Path(s['target']).name}`

A block-diffusion speculative-decoding draft (DFlash) trained with `dflash train-draft`.
Load it with `dflash generate --model TARGET --draft {out.name}` or `load_pair(target, draft)`.
Output is always the target's own greedy text; the draft only sets the speed.

## Architecture
- {c['num_hidden_layers']} draft layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads /
  {c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}, MLP {c['intermediate_size']}
- block size {c['block_size']}, mask token id {c['dflash_config']['mask_token_id']}
- target layers captured: {c['dflash_config']['target_layer_ids']} of {c['num_target_layers']}

## Training data
- {s['train_sequences']} training sequences ({_prompt_sources(o, s.get('derived_prompts'))}),
  responses by the target (up to {o['max_new_tokens']} new tokens; {f"{o.get('sampled_responses', 0):.0%} of new prompts sampled at temperature {o.get('response_temperature')}, the rest greedy" if o.get('sampled_responses') else 'greedy'}){f", the prompts of {o['exclude_prompts']} excluded" if o.get('exclude_prompts') else ''},
  {s['train_tokens']} tokens in all (prompt + response, cut at {s.get('seq_len', o['max_len'])})
- the {s.get('heldout_excluded', s['heldout_prompts'])} held-out prompts (engine/training/heldout_prompts.jsonl) were never trained on

## Training
- global step {s['steps']} of a {sched.get('total_steps', '?')}-step campaign ({s.get('session_steps', s['steps'])} this session,
  {s.get('world_size', 1)} data-parallel rank(s)), {o['seqs_per_batch']} sequences x {o['anchors_per_seq']} anchors per step and rank
- AdamW lr {sched.get('lr', o['lr'])}, linear warm-up {sched.get('warmup_steps', '?')} steps then cosine to
  {sched.get('min_lr_ratio', o['min_lr_ratio'])} x lr, grad clip {o['grad_clip']}, loss decay gamma
  {o['gamma'] or default_gamma(c['block_size'])}, KL weight {o['kl_weight']}{', labels the target argmax' if o.get('argmax_labels') else ''}; embedding and LM head frozen
- final loss {f.get('loss', float('nan')):.4f}, block accuracy@1 {f.get('acc1', float('nan')):.3f}
- device {s['device']}, target dtype {s['dtype']}, draft compute {s.get('compute_dtype', '?')} (fp32 masters);
  time: data {s['generation_time_s']:.0f}s, training {s['train_time_s']:.0f}s, evaluation {s['eval_time_s']:.0f}s

## Held-out acceptance (greedy, `stream_dflash_generate`, full verify, up to {o['eval_max_tokens']} tokens)
| prompt kind | prompts | acceptance | tokens per cycle (tau) | P(accept >= k), k = 1..6 |
|---|---|---|---|---|
{rows}
"""
    (out / "README.md").write_text(text)


def check_report_path(out: str | None) -> None:
    """Refuse a report path that cannot be written (a folder, a missing or read-only folder)
    before the evaluation runs, rather than failing after it."""
    import os

    import click

    if not out:
        return
    p = Path(out)
    if p.is_dir():
        raise click.ClickException(f"--out {out} is a folder: name the report file (e.g. {p / 'report.json'})")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise click.ClickException(f"--out {out}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise click.ClickException(f"--out {out}: not writable")
    if p.exists() and not _is_report(p):  # a model's config.json was replaced by a report
        raise click.ClickException(f"--out {out} exists and is not an eval-draft report: it would be "
                                   "replaced; name another file (or delete it first)")


def _is_report(p: Path) -> bool:
    """Whether `p` holds an earlier eval-draft report (or is empty), which --out may replace."""
    import json

    try:
        text = p.read_text()
        if not text.strip():
            return True
        body = json.loads(text)
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and {"target", "draft", "heldout"} <= body.keys()


def _eval_cli():
    import click

    from ..bench.cli import nonempty_option

    @click.command("eval-draft")
    @click.option("--target", required=True, help="Target model directory (mlx-lm format).")
    @click.option("--draft", required=True, help="Draft directory (published format or a training checkpoint).")
    @click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
    @click.option("--prompts", "n_prompts", default=None, type=click.IntRange(1), help="First N held-out prompts (default all).")
    @click.option("--heldout-file", default=None, type=click.Path(exists=True, dir_okay=False),  # before any load
                  help="Default: the committed engine/training/heldout_prompts.jsonl.")
    @click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="Default: bf16 on GPU, fp32 on CPU.")
    @click.option("--window", type=click.IntRange(2), default=None, help="Verify this many tokens a cycle instead of the whole block (blocks cut to it where the draft allows: DFLASH_SHORT_BLOCK).")
    @click.option("--rows", default=1, show_default=True, type=click.IntRange(1, 8), help="Draft rows a verify (engine/branches.py): 1 measures the draft itself; a CUDA GPU's engine verifies 8 in bf16 (DFLASH_BRANCHES), which gives more tokens a cycle from the same draft.")
    @click.option("--out", default=None, callback=nonempty_option("the report file"), help="Write the report (JSON) here.")
    def eval_draft_command(target, draft, max_tokens, n_prompts, heldout_file, dtype, window, rows, out):
        """Held-out acceptance, tau and acceptance curve of the --draft on the --target (greedy;
        every cycle verifies the whole block, or --window tokens). Ctrl-C or SIGTERM stops it
        (exit 130); with --out, the report of the prompts that finished is written first."""
        import sys

        from ..launch import stops_once  # a second Ctrl-C while the report is written: ignored

        try:
            with stops_once():
                _eval_draft(target, draft, max_tokens, n_prompts, heldout_file, dtype, window, rows, out)
        except KeyboardInterrupt as e:
            if isinstance(e, EvalInterrupted) and out and e.done:
                click.echo(f"cancelled: the {e.done} finished prompts written to {out} "
                           "(`interrupted: true`)", err=True)
            else:
                click.echo("cancelled" + (f" (nothing written to {out})" if out else ""), err=True)
            sys.exit(130)
        except OSError as e:  # the report's folder gone, no permission, disk full: one line
            raise click.ClickException(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}") from e

    def _eval_draft(target, draft, max_tokens, n_prompts, heldout_file, dtype, window, rows, out):
        """The command's work (its Ctrl-C and OSError handling above)."""
        import json

        import mlx.core as mx

        from .. import draftvocab
        from ..drafters import check_fit, short_block_max
        from ..loading import draft_dtype, load_target, resolve_model
        from . import data as td
        from .checkpoint import read_draft

        check_report_path(out)  # before minutes of evaluation, not after
        if out and Path(out).exists():  # said before the evaluation, while Ctrl-C still keeps it
            click.echo(f"[eval] {out} exists: this evaluation's report will replace it", err=True)
        try:  # a bad prompt line or an empty file: said before the model loads
            pairs = td.load_heldout(heldout_file)[:n_prompts]
        except (ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from e
        if not pairs:
            raise click.ClickException(f"no prompts in {heldout_file or td.HELDOUT_FILE}")
        try:
            model, tokenizer = load_target(resolve_model(target), target)
            dt = dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
            model.set_dtype(getattr(mx, dt))
            d = read_draft(draft, draft_dtype(model, None))
        except (ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from e
        samples = [td.Sample(k, p, td.chat_ids(tokenizer, p), [], "heldout") for k, p in pairs]
        log = lambda s: click.echo(s, err=True)  # noqa: E731
        try:
            tm = TargetModel(model, d.config.target_layer_ids)
            check_fit(d, tm)  # a draft for another target: one line, as `dflash generate` says it
            vocab = draftvocab.choose(draft, tm.vocab_size)
        except ValueError as e:
            raise click.ClickException(str(e)) from e
        if rows > 1 and not tm.takes_rows():
            raise click.ClickException(
                f"--rows {rows}: this target's verify attention cannot read several rows here "
                "(a CUDA GPU needs bf16/fp16 and the few-query kernel, engine/branches.py)")
        if rows > 1:
            log(f"[eval] {rows} draft rows a verify (tau then counts what the rows buy, not the draft alone)")
        if vocab:
            log(f"[eval] draft vocabulary: {draftvocab.describe(len(vocab))} ({draftvocab.ENV})")
        if window is not None and window > d.config.block_size:
            raise click.ClickException(f"--window {window} is over the draft's block of {d.config.block_size}")
        try:
            cut = window is not None and window <= short_block_max(d.config)
        except ValueError as e:
            raise click.ClickException(str(e)) from e
        if window is not None:
            log(f"[eval] verify window {window}, " + (f"draft blocks cut to {window} rows" if cut else "whole draft blocks"))
        answers: list[dict] = []
        rec = {"target": target, "draft": draft, "max_tokens": max_tokens, "dtype": dt,
               "draft_vocab": len(vocab) if vocab else None, "window": window or "full",
               "cut_block": bool(cut), "rows": rows, "device": str(mx.default_device()),
               "prompts": len(samples)}

        def write(report: dict, **more: Any) -> None:
            tmp = Path(f"{out}.tmp")  # whole or nothing: a full disk leaves no torn report
            tmp.write_text(json.dumps({**rec, **more, "heldout": report, "answers": answers}, indent=2) + "\n")
            tmp.replace(out)

        try:
            report = evaluate(tm, d, tokenizer, samples, max_tokens, log, vocab, window or "full",
                              answers, rows)
        except EvalInterrupted as e:  # the finished prompts are kept (a `timeout` on a GPU call)
            if out and e.done:
                write(e.report, prompts=e.done, interrupted=True, prompts_asked=len(samples))
            raise
        if out:
            write(report)
            click.echo(f"[eval] report written to {out}", err=True)

    return eval_draft_command


eval_draft_command = _eval_cli()
