"""Where a small target's decode time goes on a GPU: building the graph in Python, or the device.

    python scripts/host_probe.py --model MODEL --draft DRAFT [--out probe.json]

A 135M target decodes at ~4 ms a token on the H200 (README), far above what its weights cost to
read: the time is launch- or host-bound. This splits each kind of forward a cycle runs into
the Python time to build its graph (the call returns, nothing evaluated) and the synced total
(build + eval), for a plain step (1 token), a 16-token verify and a draft pass, each at a
cache length not used before in this process (after warm-up calls at other lengths; medians).
Then mlx-lm's own trick, a decode loop that builds step i+1 while step i runs, in ms a token;
and the same forwards with each layer's MLP compiled (mx.compile: one fused graph per shape),
which says how much fusing the small ops would buy (and whether the logits stay bitwise the
same: `mlp_compiled_logits_equal`); and the same forwards with each layer's projections that
read one input run as one product (q, k, v; gate, up: `fused_proj_`, 4 matmuls a layer instead
of 7), which says what a launch-bound host pays per matmul (`fused_proj_logits_equal`).
`--variants` picks among plain, mlp_compiled and fused_proj. With `--rows 4,8`: a greedy 16-token verify of that many
draft rows (engine/branches.py) through engine/verify.py itself (caches copied into the rows,
one batched pass, the best row kept), `verify16_rowsR`, beside the one-row `verify16_rows1`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from dflash.engine import rollback
from dflash.engine.verify import verify
from dflash.engine.loading import load_pair


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def split_times(run, repeats: int) -> dict:
    """build / total ms of run(i) (returns arrays to evaluate), each call at a new length."""
    for k in range(3):
        mx.eval(run(-1 - k))
    build, total = [], []
    for i in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        out = run(i)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        total.append(t2 - t0)
    return {"build_ms": _median_ms(build), "total_ms": _median_ms(total)}


class SharedProduct:
    """One matmul for several bias-free nn.Linear that read the same input: the first of them
    called on an input computes x @ concat(W).T, each returns its own columns of it."""

    def __init__(self, linears: list) -> None:
        self.w = mx.concatenate([lin.weight for lin in linears], axis=0)
        ends = [0]
        for lin in linears:
            ends.append(ends[-1] + lin.weight.shape[0])
        self.spans = list(zip(ends, ends[1:]))
        self.last: tuple | None = None  # (input, its product)

    def part(self, i: int):
        a, b = self.spans[i]

        def call(x: mx.array) -> mx.array:
            if self.last is None or self.last[0] is not x:
                self.last = (x, x @ self.w.T)
            return self.last[1][..., a:b]
        return call


def fuse_projections(layers) -> tuple:
    """(fuse, unfuse): swap each layer's q/k/v and gate/up projections for SharedProduct parts."""
    groups = []
    for layer in layers:
        for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                           (layer.mlp, ("gate_proj", "up_proj"))):
            lins = [getattr(mod, n) for n in names]
            if all("bias" not in lin and "scales" not in lin for lin in lins):
                groups.append((mod, names, SharedProduct(lins)))

    def fuse() -> None:
        for mod, names, shared in groups:
            for i, n in enumerate(names):
                object.__setattr__(mod, n, shared.part(i))  # the module stays the child

    def unfuse() -> None:
        for mod, names, _ in groups:
            for n in names:
                if n in mod.__dict__:
                    object.__delattr__(mod, n)
    return fuse, unfuse


def probe(args: argparse.Namespace) -> dict:
    pair = load_pair(args.model, args.draft, args.dtype)
    target, drafter = pair.target, pair.drafter
    ids = pair.tokenizer.encode("Explain how a bicycle stays upright while it moves. " * 4)
    caches = target.make_cache()
    logits, feats = target.forward(mx.array(ids)[None], caches, last_only=True)
    drafter.reset()
    drafter.add_context(feats)
    mx.eval(logits, feats, [c.state for c in caches])
    base = len(ids)
    tok = mx.argmax(logits[0, -1]).astype(mx.int32)

    def forward(width: int, eager: bool):
        def run(i: int):
            # a new cache length per call: grow by one token, then undo the rest of the block
            block = mx.full((1, width), 13, mx.int32)
            out, f = target.forward(block, caches, eager=eager)
            rollback.rewind(caches, target.layers, 1, width, None)
            return [out, f]
        return run

    def verify_rows(rows: int):
        drafts = mx.full((rows, 15), 13, mx.int32) + mx.arange(rows, dtype=mx.int32)[:, None]

        def run(i: int):  # a new cache length per call, as forward() does
            cyc = verify(target, caches, tok, drafts, False)
            rollback.rewind(caches, target.layers, 1, 16, None)
            return [cyc.summary, cyc.features]
        return run

    def propose(i: int):
        drafter.add_context(feats[:, -1:])  # one more context row: a new length per call
        return drafter.propose(tok, drafter.context_len, 15)

    # mlx-lm's loop: the next step is built on the lazy argmax of the one still running
    def loop_ms(n: int) -> float:
        y, _ = target.forward(tok.reshape(1, 1), caches)
        nxt = mx.argmax(y[0, -1]).astype(mx.int32)
        mx.async_eval(nxt)
        t0 = time.perf_counter()
        for _ in range(n):
            y, _ = target.forward(nxt.reshape(1, 1), caches)
            new = mx.argmax(y[0, -1]).astype(mx.int32)
            mx.async_eval(new)
            nxt.item()
            nxt = new
        nxt.item()
        return (time.perf_counter() - t0) / n * 1e3

    # each layer's MLP compiled (how much fusing its small ops buys); the variants alternate
    # round by round, so drift on a shared host hits them alike
    plain = [layer.mlp for layer in target.layers]
    fused = [mx.compile(m.__call__) for m in plain]

    def use(mlps) -> None:
        for layer, m in zip(target.layers, mlps):
            object.__setattr__(layer, "mlp", m)  # the module itself stays the layer's child

    def logits_of(mlps) -> mx.array:  # a 16-token block's logits at one cache state
        use(mlps)
        out, _ = target.forward(mx.arange(16, dtype=mx.int32)[None] + 100, caches)
        mx.eval(out)
        rollback.rewind(caches, target.layers, 0, 16, None)
        return out

    fuse, unfuse = fuse_projections(target.layers)
    ref = logits_of(plain)
    same = bool(mx.array_equal(ref, logits_of(fused)).item())
    use(plain)
    fuse()
    same_proj = bool(mx.array_equal(ref, logits_of(plain)).item())
    unfuse()
    variants = {"plain": ("", plain, False), "mlp_compiled": ("mlp_compiled_", fused, False),
                "fused_proj": ("fused_proj_", plain, True)}
    samples: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, mlps, proj in (variants[v] for v in args.variants):
            use(mlps)
            (fuse if proj else unfuse)()
            for kind, run in (("step", forward(1, False)), ("verify16", forward(16, False)),
                              ("verify16_eager", forward(16, True)), ("draft15", propose)):
                if not (kind == "draft15" and name):
                    samples.setdefault(name + kind, []).append(split_times(run, args.repeats))
            loop_ms(8)
            samples.setdefault(name + "loop_ms_per_token", []).append(loop_ms(64))
            unfuse()
        for rows in args.rows and [1, *args.rows]:
            samples.setdefault(f"verify16_rows{rows}", []).append(
                split_times(verify_rows(rows), args.repeats))
    use(plain)
    rows: dict[str, dict] = {}
    for key, vals in samples.items():
        if isinstance(vals[0], dict):
            rows[key] = {k: round(statistics.median(v[k] for v in vals), 3) for k in vals[0]}
            rows[key]["rounds_total_ms"] = [v["total_ms"] for v in vals]
        else:
            rows[key] = {"median": round(statistics.median(vals), 3),
                         "rounds": [round(v, 3) for v in vals]}
    return {
        "device": str(mx.default_device()), "mlx": mx.__version__, "model": args.model,
        "draft": args.draft, "dtype": args.dtype or "default", "prompt_tokens": base,
        "method": "build_ms: Python time until the forward returns (nothing evaluated); total_ms: "
                  "build + mx.eval, synced before; medians over --repeats calls, each at a cache "
                  "length not used before, after 3 warm-up calls; loops: ms a token over 64 steps; "
                  "variants alternate over --rounds rounds: medians over rounds, each round listed",
        "mlp_compiled_logits_equal": same,  # bitwise, a 16-token block at one cache state
        "fused_proj_logits_equal": same_proj,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="also time greedy verifies of these draft-row counts, e.g. 4,8,16")
    ap.add_argument("--variants", type=lambda v: [x for x in v.split(",") if x],
                    default=["plain", "mlp_compiled", "fused_proj"],
                    help="of plain, mlp_compiled, fused_proj (plain's rows carry no prefix)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = probe(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
