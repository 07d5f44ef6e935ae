"""Products that read one input, run as one: q/k/v, and gate/up (on a GPU by default).

On the H200 a small target's cycle is paced by the host, not the GPU: MLX-CUDA spends ~13 us
encoding and launching each kernel, and a 16-token verify of SmolLM2-135M launches ~450 of them
(docs/benchmark.md, "Session 20"). An attention's q, k and v projections and an MLP's gate and
up projections read the same input, so each group can be one matmul against the rows of its
weights stacked: 4 products a layer instead of 7 (session 18's probe: a 16-token verify 9.80 ->
9.05 ms, the logits equal bit for bit, bf16 on the H200 and fp32 on the CPU: each output column
is the same dot product whichever other columns share the launch).

`install(model)` stacks each group's weights once and points every member's weight (bias,
quantization scales) at its rows of the stack, so memory does not grow and a member called on
its own computes exactly what it did. Inside `active()` (the target's own forwards; the draft's)
the first member of a group called on an input computes the whole stacked product and the others
take their columns of it; outside (mlx-lm decoding the same model object: the benchmark's
baseline) every member is the plain module it was. Any module code that calls the members on one
input gets this, whatever the family: no forward is rewritten.

Groups are fused only where the members agree (one input width; all plain nn.Linear of one
dtype, or all nn.QuantizedLinear of one quantization; bias on all or none). On a CPU with MKL
the stacked product saves no time (a 16-row q/k/v 334 -> 283 us, gate/up 951 -> 1,098 us on the
2-core VM; in one process, `scripts/arms_ab.py --arm unfused:fuse=0 --arm fused:fuse=1`, 0.980x,
0.946-1.016), so there it is off by default. On the H200, bf16, identical texts: 1.109x
(1.075-1.144; docs/benchmark.md, "Session 21").

    DFLASH_FUSE=auto  (default) on a GPU;  =1 everywhere (tests);  =0 never
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import rowpad
from .scope import Scope

ENV = "DFLASH_FUSE"
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
active = Scope()  # the target's own forwards and the draft's are inside
ON = True  # False: fused members compute alone even inside active() (scripts/arms_ab.py's fuse=0)
_CLASSES: dict[type, type] = {}


def enabled() -> bool:
    """DFLASH_FUSE: auto (a GPU), 1 or 0; another value raises, naming the variable."""
    mode = os.environ.get(ENV, "").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={mode!r}: expected auto, 1 or 0")
    return mode == "1" or (mode == "auto" and mx.default_device() == mx.gpu)


class Shared:
    """The stacked product of one group: computed once per input, handed out as column spans."""

    def __init__(self, stacked: nn.Module, spans: list[tuple[int, int]]) -> None:
        self.stacked = stacked  # a module of the members' class over the stacked weights
        self.spans = spans
        self.input: mx.array | None = None
        self.parts: list[mx.array | None] = []

    def part(self, i: int, x: mx.array) -> mx.array:
        """Member i's output on x: its columns of the stacked product on x (computed if x is
        not the input the others were called on). Parts are dropped once all are taken, so no
        activation outlives its forward."""
        if self.input is not x or self.parts[i] is None:
            y = self.stacked(x)
            self.input, self.parts = x, [y[..., a:b] for a, b in self.spans]
        out, self.parts[i] = self.parts[i], None
        if all(p is None for p in self.parts):
            self.input, self.parts = None, []
        return out

    def all(self, x: mx.array) -> list[mx.array]:
        """Every member's output on x, from one product (nothing kept)."""
        y = self.stacked(x)
        return [y[..., a:b] for a, b in self.spans]


def _fused_class(cls: type) -> type:
    """A subclass of a Linear class whose call, inside `active()`, takes its part of the group."""
    if cls not in _CLASSES:

        def __call__(self, x):
            shared = self.__dict__.get("_dflash_shared")
            if shared is None or not (active and ON):
                return cls.__call__(self, x)
            return shared.part(self.__dict__["_dflash_part"], x)

        _CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"__call__": __call__})
    return _CLASSES[cls]


def _base(m: nn.Module) -> type:
    """The class a module was before any swap of ours (rowpad's or this module's)."""
    ours = (*_CLASSES.values(), *rowpad._CLASSES.values())
    cls = type(m)
    while cls in ours:
        cls = cls.__mro__[1]
    return cls


def _arrays(m: nn.Module) -> list[str]:
    """The member's arrays stacked along the output rows: weight, then scales / biases / bias."""
    return [k for k in ("weight", "scales", "biases", "bias") if k in m]


def _compatible(members: list[nn.Module]) -> bool:
    first = members[0]
    cls = _base(first)
    if cls not in (nn.Linear, nn.QuantizedLinear) or any(_base(m) is not cls for m in members):
        return False
    if any(_arrays(m) != _arrays(first) for m in members):
        return False
    if any(m.weight.dtype != first.weight.dtype or m.weight.shape[1:] != first.weight.shape[1:]
           for m in members):
        return False
    quant = ("group_size", "bits", "mode")
    return all(getattr(m, q, None) == getattr(first, q, None) for m in members for q in quant)


def stack(members: list[nn.Module]) -> Shared:
    """One product for `members` (compatible, one input): a module over their weights stacked,
    each member's output a span of its columns (`Shared.part`, `Shared.all`)."""
    names = _arrays(members[0])
    stacked = {k: mx.concatenate([m[k] for m in members], axis=0) for k in names}
    mx.eval(stacked)
    cls = _base(members[0])
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.__dict__.update({k: v for k, v in members[0].__dict__.items() if not k.startswith("_dflash")})
    for k, v in stacked.items():  # not a child of the model: its parameters are not counted twice
        module[k] = v
    spans, start = [], 0
    for m in members:  # a weight row is an output feature, packed or not
        spans.append((start, start + m.weight.shape[0]))
        start += m.weight.shape[0]
    return Shared(module, spans)


def _fuse_group(members: list[nn.Module]) -> Shared:
    """Stack a group and point its members at their rows of the stack (views: no new memory)."""
    shared = stack(members)
    names = _arrays(members[0])
    for i, (m, (a, b)) in enumerate(zip(members, shared.spans)):
        m.update({k: shared.stacked[k][a:b] for k in names})
        if type(m) not in _CLASSES.values():
            m.__class__ = _fused_class(type(m))
        m.__dict__["_dflash_shared"] = shared
        m.__dict__["_dflash_part"] = i
    return shared


def context_stack(draft: Any) -> Shared | None:
    """The draft's context K/V projections of every layer as one product (new context rows go
    through all of them at once; engine/draft.py `add_context`), or None where they do not
    stack. Its own copy of those weights (a few MB for a draft), so inference-only."""
    members = [m for layer in draft.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
    return stack(members) if members and _compatible(members) else None


def install(model: Any, force: bool = False) -> int:
    """Fuse every compatible q/k/v and gate/up group in `model`; returns how many groups are
    fused. Nothing unless enabled() or `force`. A group fused before is stacked again from its
    members' weights as they are now (a draft trained since its last drafter was made)."""
    if not (force or enabled()):
        return 0
    n = 0
    for _, parent in model.named_modules():
        for names in GROUPS:
            if not all(name in parent and isinstance(parent[name], nn.Module) for name in names):
                continue
            members = [parent[name] for name in names]
            if _compatible(members):
                _fuse_group(members)
                n += 1
    return n
