"""Few-row matmuls padded to the row count the BLAS does fastest, measured per weight shape.

MLX's CPU backend sends every fp32 matmul to cblas_sgemm, and MKL's speed is not monotonic in the
number of rows M. On the 2-core AMD EPYC VM of session 6 a one-row product was slower than a
two-row one (SmolLM2's 49152x576 LM head: 8.9 ms against 6.2 ms). On the Intel Xeon VM of
session 7 the head costs 9 ms at M=1, 22 ms at M=4, 31 ms at M=8, 49 ms at M=15 and 21 ms at M=16:
MKL switches to its fast kernel at 16 rows, so the draft's 15-row LM head (one per draft cycle)
is more than twice as fast padded to 16, and a 576x1536 MLP matmul at 10-15 rows too.

`measure(w)` times M = 1 .. MAX_ROWS rows on one weight and returns its plan {m: m'}: pad m rows
to m' > m where m' is the fastest row count >= m and at least 10% faster. `plan(model)` measures
once per process and distinct weight shape (never on a GPU: {}); `pad_rows(model, plans)` swaps
the class of the model's nn.Linear and nn.Embedding instances whose shape has a plan for
subclasses that pad (zero rows, dropped after the product: the real rows are computed as before),
but only inside `active()`: the target's own forwards enter it; the same model object run by
mlx-lm (the benchmark's baseline) is left exactly as mlx-lm runs it.
DFLASH_PAD_ROWS=0 turns it off; =1 forces the plan {1: 2} on every eligible module (tests).
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from .scope import Scope

ENV = "DFLASH_PAD_ROWS"
MAX_ROWS = 16  # a DFlash block: the verify and the draft's LM head never go beyond it
FORCED = {1: 2}
active = Scope()  # the target's own forwards are inside (TargetModel enters it)
_CLASSES: dict[type, type] = {}
_measured: dict[tuple, dict[int, int]] = {}
Plans = dict[tuple, dict[int, int]]  # weight shape -> {rows: padded rows}


def _pad(x: mx.array, rows: int) -> mx.array:
    """x [..., m, d] with zero rows appended up to `rows`."""
    extra = mx.zeros((*x.shape[:-2], rows - x.shape[-2], x.shape[-1]), dtype=x.dtype)
    return mx.concatenate([x, extra], axis=-2)


def _padded_class(cls: type) -> type:
    """A subclass of nn.Linear / nn.Embedding whose product (__call__ / as_linear) pads an input
    of m rows to its plan's m' rows and returns the first m."""
    if cls not in _CLASSES:
        name = "as_linear" if issubclass(cls, nn.Embedding) else "__call__"
        product = getattr(cls, name)

        def padded(self, x):
            to = self.__dict__["_dflash_rows"].get(x.shape[-2]) if active and x.ndim >= 2 else None
            if to:
                return product(self, _pad(x, to))[..., : x.shape[-2], :]
            return product(self, x)

        _CLASSES[cls] = type(f"RowPadded{cls.__name__}", (cls,), {name: padded})
    return _CLASSES[cls]


def _eligible(model: nn.Module) -> list[nn.Module]:
    """The model's plain fp32 Linear / Embedding modules (quantized and half ones never reach BLAS)."""
    kinds = (nn.Linear, nn.Embedding, *_CLASSES.values())  # a model wrapped twice: padded already
    return [m for _, m in model.named_modules() if type(m) in kinds and m.weight.dtype == mx.float32]


def measure(w: mx.array, max_rows: int = MAX_ROWS, reps: int | None = None) -> dict[int, int]:
    """{m: m'} for x [1, m, d] @ w.T: the fastest row count m' >= m, where >= 10% faster than m.

    Each row count is timed `reps` times, round robin (a drifting machine skews none), medians;
    by default 3 for a large weight (an LM head: ~1 s in all) and 15 for a small one, whose
    sub-millisecond products are noisier and cheap to repeat.
    """
    reps = reps or (3 if w.size >= 4_000_000 else 15)
    xs = [mx.random.normal((1, m, w.shape[-1]), key=mx.random.key(m)) for m in range(1, max_rows + 1)]
    mx.eval(xs, [x @ w.T for x in xs])  # warm-up
    times: list[list[float]] = [[] for _ in xs]
    for _ in range(reps):
        for x, ts in zip(xs, times):
            t = time.perf_counter()
            mx.eval(x @ w.T)
            ts.append(time.perf_counter() - t)
    return choose([statistics.median(ts) for ts in times])


def choose(times: list[float], min_gain_s: float = 25e-6) -> dict[int, int]:
    """The plan from the times (s) of 1, 2, .. rows: m -> the fastest m' >= m (the fewest rows
    among equals), where it is at least 10% and `min_gain_s` faster than m itself (a small
    weight's product takes ~0.1 ms, and its timing noise alone can look like 10%)."""
    out = {}
    for m in range(1, len(times) + 1):
        best = min(range(m, len(times) + 1), key=lambda r: (times[r - 1], r))
        gain = times[m - 1] - times[best - 1]
        if best > m and gain > 0.1 * times[m - 1] and gain > min_gain_s:
            out[m] = best
    return out


def plan(model: nn.Module) -> Plans:
    """The row plan of each distinct eligible weight shape: DFLASH_PAD_ROWS if set, none on a GPU,
    else measured once per process and shape."""
    shapes = {tuple(m.weight.shape): m.weight for m in _eligible(model)}
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return {k: dict(FORCED) if forced == "1" else {} for k in shapes}
    if mx.default_device() != mx.cpu:
        return {k: {} for k in shapes}
    for k, w in shapes.items():
        if k not in _measured:
            _measured[k] = measure(w)
    return {k: _measured[k] for k in shapes}


def pad_rows(model: nn.Module, plans: Plans) -> int:
    """Swap the classes of `model`'s eligible modules whose weight shape has a non-empty plan;
    return how many."""
    n = 0
    for m in _eligible(model):
        rows = dict(plans.get(tuple(m.weight.shape)) or {})
        if rows and type(m) not in _CLASSES.values():
            m.__class__ = _padded_class(type(m))
        if type(m) in _CLASSES.values():  # (a module padded before takes the new plan)
            m.__dict__["_dflash_rows"] = rows
        n += bool(rows)
    return n


def describe(plans: Plans) -> dict[str, dict[int, int]]:
    """The non-empty plans, keyed "OUTxIN" (for the benchmark JSON)."""
    return {"x".join(map(str, k)): v for k, v in plans.items() if v}
