"""What a grown draft's pass would cost on this machine, before any training (engine/training/grow.py).

    python scripts/draft_cost.py --model models/SmolLM2-135M-Instruct [--mlp 2304,3072] [--layers 3]

Times one draft pass (the whole block, B-1 rows through the LM head, as `DFlashDrafter.propose`
runs it) of the pair's draft and of the same draft grown wider (`--grow-mlp W`) or deeper
(`--grow-layers N`), over a context of `--context` rows of real target features, in interleaved
rounds (medians; the VM's speed drifts, so every variant runs in every round). Growth keeps the
proposals, not the cost: this says how much more tau a grown draft must buy to pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from dflash.engine import accel
from dflash.engine.drafters import DFlashDrafter
from dflash.engine.loading import load_pair
from dflash.engine.training.grow import grow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None, help="default: the registry's draft for the model")
    ap.add_argument("--mlp", default="", help="comma-separated MLP widths to grow to")
    ap.add_argument("--layers", type=int, default=0, help="layers to grow by (0: none)")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    a = ap.parse_args()
    accel.maybe_reexec()  # MKL on the CPU, as dflash's commands run (without it: the BLAS trap)
    pair = load_pair(a.model, a.draft)
    target, base = pair.target, pair.drafter
    vocab = None if base.head is None else base.head.ids.tolist()  # the pair's own subset
    variants = {f"as is (MLP {base.draft.config.intermediate_size}, "
                f"{base.draft.config.num_hidden_layers} layers)": base}
    for width in [int(w) for w in a.mlp.split(",") if w.strip()]:
        variants[f"MLP {width}"] = DFlashDrafter(grow(base.draft, 0, width), target, vocab)
    if a.layers:
        variants[f"+{a.layers} layers"] = DFlashDrafter(grow(base.draft, a.layers), target, vocab)
    ids = mx.random.randint(0, target.vocab_size, (1, a.context), key=mx.random.key(0))
    _, feats = target.capture(lambda: target.inner(ids))
    for d in variants.values():  # grown drafts keep the draft's dtype (grow.py)
        d.reset()
        d.add_context(feats)
        mx.eval([c.state for c in d.cache])
    anchor = mx.array(ids[0, -1].item())
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, d in variants.items():
            mx.eval(d.propose(anchor, a.context))  # warm
            xs = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                mx.eval(d.propose(anchor, a.context))
                xs.append(time.perf_counter() - t)
            times[name].append(statistics.median(xs) * 1e3)
    out = {}
    for name, xs in times.items():
        out[name] = round(statistics.median(xs), 2)
        print(f"{name}: draft pass {out[name]:.1f} ms (rounds {min(xs):.1f}-{max(xs):.1f})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "context": a.context, "rounds": a.rounds,
                       "repeats": a.repeats, "median_ms": out}, f, indent=2)


if __name__ == "__main__":
    main()
