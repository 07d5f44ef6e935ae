"""Tokens per cycle with 1, 2, 4, 8 draft rows (engine/branches.py), replayed on held-out prompts.

    python scripts/branch_replay.py --target models/SmolLM2-135M-Instruct \
        --draft engine/drafts/SmolLM2-135M-Instruct-DFlash [--prompts N] [--out replay.json]

For each held-out prompt (engine/training/heldout_prompts.jsonl, chat template) it takes the
target's greedy answer (mlx-lm), runs the target once over prompt + answer for the draft's
context features, then scores the draft at every answer position as an anchor and keeps, per
row count R, `branches.rows_from_logits(logits, R)`. A row's accepted length is its longest
prefix equal to the greedy answer (`verify.greedy_accept`, what a greedy verify accepts), so
the cycles of a full-window generation are replayed without running a verify: anchor p, accept
the best row's a tokens, next anchor p + a + 1. Tokens per cycle per R, over all prompts. The
draft sees the full vocabulary (as `DFLASH_DRAFT_VOCAB=full`), in the target's dtype.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from dflash.engine import accel, branches
from dflash.engine.draft import load_draft
from dflash.engine.loading import draft_dtype
from dflash.engine.target import TargetModel
from dflash.engine.training import data as td
from dflash.engine.verify import greedy_accept

ROWS = (1, 2, 4, 8)


def replay(args: argparse.Namespace) -> dict:
    model, tok = load(args.target)
    model.set_dtype(getattr(mx, args.dtype))
    draft = load_draft(args.draft, draft_dtype(model, None))
    target = TargetModel(model, draft.config.target_layer_ids)
    b = draft.config.block_size
    masks = mx.full((b - 1,), draft.config.mask_token_id, mx.int32)
    totals = {r: [0, 0] for r in ROWS}  # R -> [cycles, tokens]
    t0 = time.time()
    prompts = td.load_heldout(args.heldout_file)[: args.prompts]
    for i, (kind, text) in enumerate(prompts):
        ids = td.chat_ids(tok, text)
        answer = []
        for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=args.max_tokens),
                             range(args.max_tokens)):
            answer.append(int(t))
            if int(t) in tok.eos_token_ids:
                break
        seq = ids + answer
        _, feats = target.capture(lambda: model(mx.array(seq)[None]))
        cache = draft.make_cache()
        draft.add_context(feats[:, : len(ids)], cache)
        best: dict[int, list[int]] = {r: [] for r in ROWS}  # R -> accepted at each anchor
        for p in range(len(ids), len(seq) - 1):
            block = mx.concatenate([mx.array([seq[p]], mx.int32), masks])[None]
            logits = target.lm_head(draft(target.embed(block), p, cache)[:, 1:])[0]
            rest = mx.array(seq[p + 1 : p + b], mx.int32)  # what a greedy verify would accept
            for r in ROWS:
                rows = branches.rows_from_logits(logits, r)[:, : rest.size]
                best[r].append(greedy_accept(rows, rest).max().item())
            draft.add_context(feats[:, p : p + 1], cache)
        for r in ROWS:
            p = 0
            while p < len(best[r]):
                totals[r][0] += 1
                totals[r][1] += best[r][p] + 1
                p += best[r][p] + 1
        print(f"[replay] {i + 1}/{len(prompts)} {kind}: " + ", ".join(
            f"R={r} {totals[r][1] / totals[r][0]:.2f}" for r in ROWS) + f" ({time.time() - t0:.0f} s)",
            flush=True)
    return {"target": args.target, "draft": args.draft, "dtype": args.dtype,
            "device": str(mx.default_device()), "prompts": len(prompts), "max_tokens": args.max_tokens,
            "method": "greedy answers by mlx-lm; the draft scored at every answer position; "
                      "full-window cycles replayed: the best row's accepted prefix + 1 token a cycle",
            "tokens_per_cycle": {str(r): round(totals[r][1] / totals[r][0], 3) for r in ROWS},
            "cycles": {str(r): totals[r][0] for r in ROWS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--heldout-file", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    accel.maybe_reexec()  # MKL on the CPU, as dflash's commands run (without it: the BLAS trap)
    result = replay(args)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
