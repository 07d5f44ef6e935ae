"""Prefix snapshots on the engine side: capture every cache after a prompt prefix, restore it.

A snapshot taken after n prompt tokens holds what resuming needs without recomputing them:
each target cache in a form that restores exactly (attention K/V up to n; quantized K/V;
a sliding window as its temporally ordered buffer + offset; Gated DeltaNet conv + recurrent
state), the draft's context K/V for the same n rows, and the logits of token n-1 (so a prompt
that is entirely cached needs no forward before its first token). Snapshots are taken before
KV quantization (kv_bits), so one snapshot serves both settings.

Live snapshots hold MLX arrays (that is what L1 keeps); `encode`/`Snapshot.decode` convert to
and from the byte format of dflash.cache.snapshot for L2. MLX arrays are immutable values, and
restore hands each cache fresh array objects, so a restored request never alters the snapshot.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from dflash.cache import snapshot as fmt
from dflash.cache.snapshot import CorruptSnapshot
from .rollback import cache_kind

log = logging.getLogger("dflash.engine.prefix")

_MX_DTYPES = {
    "bool": mx.bool_, "uint8": mx.uint8, "uint16": mx.uint16, "uint32": mx.uint32,
    "uint64": mx.uint64, "int8": mx.int8, "int16": mx.int16, "int32": mx.int32,
    "int64": mx.int64, "float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
}
_NAMES = {v: k for k, v in _MX_DTYPES.items()}


class SnapshotMismatch(ValueError):
    """The snapshot does not fit these caches (other model, other cache layout)."""


@dataclass
class Snapshot:
    """Caches after exactly n_tokens prompt tokens. Layer states are dicts of ints and arrays."""

    n_tokens: int
    target: list[dict[str, Any]]
    draft: list[dict[str, Any]] | None
    logits: mx.array  # [1, 1, V]: the prediction for token n_tokens

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays())

    def _arrays(self) -> list[mx.array]:
        out = [self.logits]
        for st in self.target + (self.draft or []):
            out.extend(_state_arrays(st))
        return out

    def body(self) -> dict[str, Any]:
        """The msgpack-able map for dflash.cache.snapshot.encode; arrays as views, not copies.

        Runs on the engine thread (all MLX work happens here); encoding the map to bytes is
        plain memory work that the prefix cache's writer thread does.
        """
        mx.eval(self._arrays())
        return {
            "n_tokens": self.n_tokens,
            "target": [_encode_state(st) for st in self.target],
            "draft": None if self.draft is None else [_encode_state(st) for st in self.draft],
            "logits": _to_record(self.logits),
        }

    def encode(self) -> bytes | memoryview:
        """The checked byte form (dflash.cache.snapshot) for the cache process."""
        return fmt.encode(self.body())

    @classmethod
    def decode(cls, data: bytes) -> "Snapshot":
        """Verify and rebuild; raises CorruptSnapshot for anything malformed."""
        body = fmt.decode(data)
        try:
            draft = body["draft"]
            snap = cls(
                n_tokens=int(body["n_tokens"]),
                target=[_decode_state(st) for st in body["target"]],
                draft=None if draft is None else [_decode_state(st) for st in draft],
                logits=_from_record(body["logits"]),
            )
        except CorruptSnapshot:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshot(f"malformed snapshot body: {e}") from e
        return snap


# --- capture / restore -------------------------------------------------------------------------
def take(caches: Sequence[Any], drafter: Any, logits: mx.array, n_tokens: int) -> Snapshot:
    """Snapshot the target caches, the draft's context cache and the last logits."""
    target = [_own(_capture(c)) for c in caches]
    dcache = getattr(drafter, "cache", None)
    draft = None if dcache is None else [_own(_capture(c)) for c in dcache]
    snap = Snapshot(n_tokens, target, draft, mx.contiguous(logits[:, -1:, :]))
    mx.eval(snap._arrays())  # compact copies now; the live caches keep changing
    return snap


def _own(st: dict[str, Any]) -> dict[str, Any]:
    """The state with copies that own their memory. A slice of a cache is a view that keeps the
    cache's whole buffer alive (KV caches grow in 256-token steps), so an L1 entry of a short
    prompt held ~8x its nbytes and L1's byte budget undercounted it (scripts/soak.py found it)."""
    def own(v: Any) -> Any:
        if isinstance(v, mx.array):
            return mx.contiguous(v)
        if isinstance(v, (list, tuple)):
            return type(v)(own(a) for a in v)
        return v

    return {k: own(v) for k, v in st.items()}


def check_fits(snap: Snapshot, caches: Sequence[Any], drafter: Any) -> None:
    """Raise SnapshotMismatch unless `snap` can be restored into these (fresh) caches.

    Besides the layout (layer count, cache kinds, offsets), every array must have the dtype and
    shape (heads, head dim, state sizes; rows = offset) that the loaded model computes: the cache
    key already binds a snapshot to its model, this guards against a key that lies (a model
    changed in a way its identity does not see) and against a malformed body. Nothing is touched
    here, so a snapshot that does not fit leaves the caches as they were: fresh.
    """
    if len(snap.target) != len(caches):
        raise SnapshotMismatch(f"{len(snap.target)} cache states for {len(caches)} layers")
    for i, (st, c) in enumerate(zip(snap.target, caches)):
        if not isinstance(st, dict) or st.get("kind") != cache_kind(c):
            kind = st.get("kind") if isinstance(st, dict) else type(st).__name__
            raise SnapshotMismatch(f"layer {i}: snapshot {kind}, cache {cache_kind(c)}")
        _check_state(st, snap.n_tokens, f"layer {i}")
        if st["kind"] == "gdn" and len(st["arrays"]) != len(c.cache):
            raise SnapshotMismatch(f"layer {i}: recurrent state size differs")
        if st["kind"] == "rotating" and (st["keep"], st["max_size"]) != (c.keep, c.max_size):
            raise SnapshotMismatch(f"layer {i}: sliding window keep/size {st['keep']}/{st['max_size']}, "
                                   f"cache {c.keep}/{c.max_size}")
    dcache = getattr(drafter, "cache", None)
    if (snap.draft is None) != (dcache is None):
        raise SnapshotMismatch("draft context presence differs")
    if dcache is not None and len(snap.draft) != len(dcache):
        raise SnapshotMismatch("draft layer count differs")
    for i, st in enumerate(snap.draft or []):
        if not isinstance(st, dict) or st.get("kind") != "kv":
            raise SnapshotMismatch(f"draft layer {i}: not a kv state")
        _check_state(st, snap.n_tokens, f"draft layer {i}")
    if not isinstance(snap.logits, mx.array) or snap.logits.ndim != 3 or snap.logits.shape[:2] != (1, 1):
        raise SnapshotMismatch("last logits are not [1, 1, V]")
    want = model_layout(drafter)
    if want is not None:
        _check_layout(snap, want)


# fields of each kind: (ints, single arrays, lists of arrays)
_FIELDS = {
    "kv": (("offset",), ("keys", "values"), ()),
    "rotating": (("offset", "keep", "max_size"), ("keys", "values"), ()),
    "quantized": (("offset", "group_size", "bits"), (), ("keys", "values")),
    "gdn": ((), (), ("arrays",)),
}


def _check_state(st: dict[str, Any], n: int, where: str) -> None:
    """Every field the kind needs, of the right type, with rows that agree with the offset."""
    ints, arrays, lists = _FIELDS.get(st.get("kind"), (None, None, None))
    if ints is None:
        raise SnapshotMismatch(f"{where}: unknown cache kind {st.get('kind')!r}")
    for f in ints:
        if type(st.get(f)) is not int or st[f] < 0:
            raise SnapshotMismatch(f"{where}: {f} missing or not an int")
    for f in arrays:
        if not isinstance(st.get(f), mx.array) or st[f].ndim != 4:
            raise SnapshotMismatch(f"{where}: {f} missing or not a 4-d array")
    for f in lists:
        v = st.get(f)
        if not isinstance(v, (list, tuple)) or not all(a is None or isinstance(a, mx.array) for a in v):
            raise SnapshotMismatch(f"{where}: {f} missing or not a list of arrays")
    if "offset" in ints and st["offset"] != n:
        raise SnapshotMismatch(f"{where}: a cache holds {st['offset']} rows, expected {n}")
    kind = st["kind"]
    if kind == "kv" and not st["keys"].shape[2] == st["values"].shape[2] == n:
        raise SnapshotMismatch(f"{where}: {st['keys'].shape[2]} key rows for offset {n}")
    if kind == "rotating" and not 0 < st["keys"].shape[2] == st["values"].shape[2] <= n:
        raise SnapshotMismatch(f"{where}: {st['keys'].shape[2]} window rows for offset {n}")
    if kind == "quantized":
        parts = [*st["keys"], *st["values"]]
        if not parts or any(a is None or a.ndim != 4 or a.shape[2] != n for a in parts):
            raise SnapshotMismatch(f"{where}: quantized rows do not match offset {n}")


# --- what the loaded model computes: dtypes and shapes of its cache states ---------------------
_LAYOUTS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def model_layout(drafter: Any) -> tuple[list, list | None, tuple] | None:
    """(target state layouts, draft state layouts, logits layout) of the drafter's target pair,
    measured once per drafter by one token through scratch caches (the model's own dtypes and
    shapes, whatever its family); None when the drafter does not say its target."""
    target = getattr(drafter, "target", None)
    draft = getattr(drafter, "draft", None)
    if target is None or not hasattr(target, "make_cache") or not hasattr(draft, "make_cache"):
        return None
    try:
        return _LAYOUTS[drafter]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: measured each time
        return _measure(drafter, target, draft)
    _LAYOUTS[drafter] = layout = _measure(drafter, target, draft)
    return layout


def _measure(drafter: Any, target: Any, draft: Any) -> tuple[list, list | None, tuple] | None:
    caches = target.make_cache()
    saved = drafter.cache
    try:
        logits, features = target.forward(mx.array([[0]], dtype=mx.int32), caches, last_only=True)
        drafter.cache = draft.make_cache()
        drafter.add_context(features)
        probe = take(caches, SimpleNamespace(cache=drafter.cache), logits, 1)
    except Exception:  # cannot measure (an unusual target): the key alone has to do
        log.warning("could not measure the model's cache layout; snapshots are checked by key only",
                    exc_info=True)
        return None
    finally:
        drafter.cache = saved
    return ([_state_layout(st) for st in probe.target],
            None if probe.draft is None else [_state_layout(st) for st in probe.draft],
            _array_layout(probe.logits, None))


def _array_layout(a: Any, seq_axis: int | None) -> tuple | None:
    """dtype and shape of one array, the sequence axis left out (its length is the prefix's)."""
    if a is None:
        return None
    shape = list(a.shape)
    if seq_axis is not None and len(shape) > abs(seq_axis):
        shape[seq_axis] = None
    return str(a.dtype), tuple(shape)


def _state_layout(st: dict[str, Any]) -> dict[str, Any]:
    seq = None if st.get("kind") == "gdn" else 2
    out: dict[str, Any] = {}
    for f, v in st.items():
        if isinstance(v, mx.array):
            out[f] = _array_layout(v, seq)
        elif isinstance(v, (list, tuple)):
            out[f] = [_array_layout(a, seq) for a in v]
    return out


def _quantized_layout(w: dict[str, Any], group_size: int, bits: int) -> dict[str, Any]:
    """What mx.quantize makes of K/V laid out as `w`: packed uint32 words, scales and biases."""
    out = {}
    for f in ("keys", "values"):
        if w.get(f) is None:
            continue
        dtype, (*lead, dim) = w[f]
        out[f] = [("mlx.core.uint32", (*lead, dim * bits // 32)),
                  (dtype, (*lead, dim // group_size)), (dtype, (*lead, dim // group_size))]
    out["bits"] = bits
    return out


def _check_layout(snap: Snapshot, want: tuple[list, list | None, tuple]) -> None:
    target, draft, logits = want
    pairs = [(f"layer {i}", st, w) for i, (st, w) in enumerate(zip(snap.target, target))]
    if draft is not None and snap.draft is not None:
        if len(draft) != len(snap.draft):
            raise SnapshotMismatch("draft layer count differs from the loaded draft")
        pairs += [(f"draft layer {i}", st, w) for i, (st, w) in enumerate(zip(snap.draft, draft))]
    for where, st, w in pairs:
        got = _state_layout(st)
        if st["kind"] == "quantized" and "bits" not in w:
            w = _quantized_layout(w, st["group_size"], st["bits"])
        for f in set(got) & set(w):  # a rotating snapshot for a plain KV probe shares its fields
            if got[f] != w[f]:
                raise SnapshotMismatch(f"{where}: {f} is {got[f]}, the loaded model makes {w[f]}")
    if _array_layout(snap.logits, None) != logits:
        raise SnapshotMismatch(f"last logits are {_array_layout(snap.logits, None)}, "
                               f"the loaded model makes {logits}")


def restore(snap: Snapshot, caches: list[Any], drafter: Any) -> mx.array:
    """Fill fresh caches (and the drafter's context) from `snap`; return its last logits.

    All or nothing: everything is checked first, and should applying fail anyway, every cache
    is put back as it was, so the caller's cold prefill starts from fresh caches."""
    check_fits(snap, caches, drafter)
    saved = [_attrs(c) for c in caches]
    try:
        for st, c in zip(snap.target, caches):
            _apply(st, c)
        fresh = None
        if snap.draft is not None:
            fresh = []
            for st in snap.draft:
                c = KVCache()
                _apply(st, c)
                fresh.append(c)
        logits = snap.logits[...]
    except Exception:
        for c, attrs in zip(caches, saved):
            c.__dict__.clear()
            c.__dict__.update(attrs)
        raise
    if fresh is not None:
        drafter.cache = fresh
    return logits


def _attrs(c: Any) -> dict[str, Any]:
    """A cache's attributes, its lists copied (ArraysCache updates one in place)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(c).items()}


def _capture(c: Any) -> dict[str, Any]:
    kind = cache_kind(c)
    if kind == "rotating":
        k, v = _temporal(c, c.keys), _temporal(c, c.values)
        return {"kind": kind, "keys": k, "values": v, "offset": c.offset,
                "keep": c.keep, "max_size": c.max_size}
    if kind == "quantized":
        n = c.offset
        return {"kind": kind, "keys": [a[..., :n, :] for a in c.keys],
                "values": [a[..., :n, :] for a in c.values], "offset": n,
                "group_size": c.group_size, "bits": c.bits}
    if kind == "kv":
        n = c.offset
        return {"kind": kind, "keys": c.keys[..., :n, :], "values": c.values[..., :n, :],
                "offset": n}
    if kind == "gdn":
        if c.left_padding is not None or c.lengths is not None:
            raise SnapshotMismatch("batched recurrent caches are not snapshotted")
        return {"kind": kind, "arrays": list(c.cache)}
    raise SnapshotMismatch(f"no snapshot for a {kind} cache")


def _temporal(c: RotatingKVCache, a: mx.array) -> mx.array:
    """The rotating buffer's rows in the order they were written (oldest first)."""
    idx, keep = c._idx, c.keep
    if idx == a.shape[2]:
        return a
    if idx < c.offset:  # wrapped in place: [kept rows][idx..end][keep..idx]
        return mx.concatenate([a[..., :keep, :], a[..., idx:, :], a[..., keep:idx, :]], axis=2)
    return a[..., :idx, :]


def _apply(st: dict[str, Any], c: Any) -> None:
    kind = st["kind"]
    if kind == "rotating":
        # Temporal order with _idx at the end is exactly the layout a multi-token update leaves.
        c.keys, c.values = st["keys"][...], st["values"][...]
        c.offset, c.keep, c.max_size = st["offset"], st["keep"], st["max_size"]
        c._idx = c.keys.shape[2]
    elif kind == "quantized":
        c.keys = tuple(a[...] for a in st["keys"])
        c.values = tuple(a[...] for a in st["values"])
        c.offset, c.group_size, c.bits = st["offset"], st["group_size"], st["bits"]
    elif kind == "kv":
        c.keys, c.values, c.offset = st["keys"][...], st["values"][...], st["offset"]
    elif kind == "gdn":
        for i, a in enumerate(st["arrays"]):
            c[i] = None if a is None else a[...]


# --- byte form of one cache state ----------------------------------------------------------
def _state_arrays(st: dict[str, Any]) -> list[mx.array]:
    out = []
    for v in st.values():
        if isinstance(v, mx.array):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(a for a in v if isinstance(a, mx.array))
    return out


def _encode_state(st: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in st.items():
        if isinstance(v, mx.array):
            out[k] = _to_record(v)
        elif isinstance(v, (list, tuple)):
            out[k] = [None if a is None else _to_record(a) for a in v]
        else:
            out[k] = v
    return out


_ARRAY_FIELDS = {"rotating": ("keys", "values"), "kv": ("keys", "values")}
_LIST_FIELDS = {"quantized": ("keys", "values"), "gdn": ("arrays",)}


def _decode_state(st: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(st, dict):  # a checksum-valid body's layer that is no map: corrupt, dropped
        raise CorruptSnapshot(f"a cache state is not a map but a {type(st).__name__}")
    kind = st.get("kind")
    if kind not in ("rotating", "kv", "quantized", "gdn"):
        raise CorruptSnapshot(f"unknown cache kind {kind!r}")
    out = dict(st)
    for f in _ARRAY_FIELDS.get(kind, ()):
        out[f] = _from_record(st[f])
    for f in _LIST_FIELDS.get(kind, ()):
        out[f] = [None if r is None else _from_record(r) for r in st[f]]
    if kind == "quantized":
        out["keys"], out["values"] = tuple(out["keys"]), tuple(out["values"])
    return out


def _to_record(a: mx.array) -> dict[str, Any]:
    name = _NAMES[a.dtype]
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # numpy has no bfloat16
    # a view of the array's own memory: fmt.encode copies it once, into the envelope (in
    # pieces, so the copy never holds the GIL for long: cache/snapshot.py _assemble)
    return fmt.array_record(name, a.shape, memoryview(np.ascontiguousarray(raw)).cast("B"))


def _from_record(rec: dict[str, Any]) -> mx.array:
    fmt.check_record(rec)
    name = rec["dtype"]
    np_dtype = np.dtype("<u2") if name == "bfloat16" else np.dtype(name).newbyteorder("<")
    arr = mx.array(np.frombuffer(rec["data"], dtype=np_dtype).reshape(rec["shape"]))
    return arr.view(mx.bfloat16) if name == "bfloat16" else arr


# --- the engine's per-request helper -----------------------------------------------------------
class PrefixSession:
    """One request against a prefix cache: restore the longest stored prefix, capture new ones.

    `prefix_cache` needs lookup(ids) -> (n, snapshot) | None and insert(ids, snapshot); an
    optional boundaries(n_prompt) says where to capture (default: the end of the prompt).
    Cache trouble never fails the request: it is logged and the prompt is prefilled cold.
    """

    def __init__(self, prefix_cache: Any, ids: Sequence[int], caches: list[Any], drafter: Any):
        self.cache = prefix_cache
        self.ids = list(ids)
        self.caches = caches
        self.drafter = drafter
        bounds = getattr(prefix_cache, "boundaries", None)
        self.marks = sorted(set(bounds(len(self.ids)) if bounds else [len(self.ids)]))

    def restore(self) -> tuple[int, mx.array | None]:
        """(tokens restored, last logits) from the longest hit, or (0, None).

        A snapshot that does not fit the loaded model is dropped from the cache (counted,
        logged once per reason) and the prompt is prefilled cold from fresh caches."""
        n = 0
        try:
            found = self.cache.lookup(self.ids)
            if found is None:
                return 0, None
            n, snap = found
            if not 0 < n <= len(self.ids) or snap.n_tokens != n:
                raise SnapshotMismatch(f"lookup returned {n} tokens for a {snap.n_tokens} snapshot")
            return n, restore(snap, self.caches, self.drafter)
        except SnapshotMismatch as e:
            _warn_once(f"prefix snapshot does not fit the loaded model ({e}): dropped, prefilling cold")
            discard = getattr(self.cache, "discard", None)
            if discard is not None and 0 < n <= len(self.ids):
                try:
                    discard(self.ids[:n])
                except Exception:
                    log.exception("could not drop a prefix snapshot")
            return 0, None
        except Exception:
            log.exception("prefix cache lookup failed; prefilling cold")
            return 0, None

    def capture(self, n: int, logits: mx.array) -> None:
        """Snapshot the caches, which now hold exactly ids[:n], and insert it."""
        try:
            self.cache.insert(self.ids[:n], take(self.caches, self.drafter, logits, n))
        except Exception:
            log.exception("prefix cache insert failed at %d tokens", n)


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    """A warning the first time it is seen (at most 64 distinct ones), then debug lines only."""
    if msg in _WARNED or len(_WARNED) >= 64:
        log.debug("%s", msg)
        return
    _WARNED.add(msg)
    log.warning("%s", msg)
