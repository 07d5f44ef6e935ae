"""The worker's side of the tiered prefix cache: identity of the loaded pair, the PrefixCache
(L1 in RAM + the cache process as L2), the per-job cache policy, and the stats it reports.

Built on the MLX thread once the pair is loaded; the PrefixCache is then used only there. The
socket thread has its own CacheClient (position lists, remote stats), so neither thread ever
waits on the other's cache round trip.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Sequence

from dflash.cache.client import CacheClient
from dflash.cache.tiers import Identity, PrefixCache

from .config import DaemonConfig
from .protocol import damaged_store_line

log = logging.getLogger("dflash.worker")
_CONFIG_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "tokenizer.json")


def dir_fingerprint(path: str | Path) -> str:
    """A content hash of a model directory's config files, plus its weight files' names, sizes,
    modification times and change times. Sizes alone missed weights rewritten in place (a
    fine-tune saved over the model: same shapes, same sizes), and the old weights' snapshots were
    restored into the new model: cached output no longer equal to uncached. The modification time
    alone missed weights replaced by a copy that keeps the old time (`cp -p`, `rsync -a`, `tar x`,
    a reproducible image build): the change time cannot be set, and any write moves it. A copy,
    or a chmod, only costs cold prefills."""
    p = Path(path)
    h = hashlib.blake2b(digest_size=16)
    for name in _CONFIG_FILES:
        f = p / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    for f in sorted(p.glob("*.safetensors")):  # a full weights hash would cost seconds per GB
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}\0".encode())
    return h.hexdigest()


def pair_identity(pair: Any, dtype: str | None) -> Identity:
    """Everything besides the prompt's token ids that decides a snapshot of this pair."""
    model, draft = model_dir(pair.model_path), Path(pair.draft_path).expanduser().resolve()
    template = getattr(pair.tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = repr(template)
    return Identity(
        target=f"{model}|{dtype or 'native'}|{dir_fingerprint(model)}|{compute_identity()}",
        draft=f"{draft}|{_draft_dtype(pair)}|{dir_fingerprint(draft)}",
        layer_ids=tuple(int(i) for i in pair.drafter.layer_ids),
        template=hashlib.sha256(template.encode()).hexdigest(),
    )


def model_dir(model: str) -> Path:
    """The folder the model was loaded from. `pair.model_path` is the model as the config names
    it: a Hugging Face repo id or a `~/...` path named no folder here, so the fingerprint hashed
    nothing and the identity stayed the same when the weights changed (a new revision in the HF
    cache, a fine-tune saved over `~/models/x`): the old weights' snapshots were restored into
    the new model."""
    from dflash.engine.loading import resolve_model

    try:
        return Path(resolve_model(model)).resolve()
    except Exception:  # loaded, so this is a race with the folder going away: still a folder name
        return Path(model).expanduser().resolve()


def compute_identity() -> str:
    """What computes the prefix: MLX version, device, BLAS and kernel switches. The same weights
    under another of these (blas = mkl, then none) round differently, so a snapshot taken under
    one restored under another gave output that the uncached run under it does not."""
    import mlx.core as mx

    from dflash.engine import accel

    return f"mlx {mx.__version__}|{mx.default_device()}|{accel.describe()}"


def _draft_dtype(pair: Any) -> str:
    """The dtype the loaded draft computes in (snapshots hold its context K/V): with no --dtype
    it follows the target (engine/loading.py draft_dtype), so the option alone does not say it."""
    from dflash.engine.loading import main_dtype

    return main_dtype(pair.drafter.draft) or "unknown"


def build_prefix_cache(cfg: DaemonConfig, pair: Any) -> PrefixCache:
    """L1 within the configured budgets, write-through to the cache process; snapshots larger
    than the cache process's size limit (`l2_cache_gb`, the same bytes the supervisor passes as
    --size-limit) are kept in L1 only instead of being encoded and sent to be refused."""
    from dflash.engine.prefix import Snapshot

    ident = pair_identity(pair, cfg.dtype)
    client = CacheClient(cfg.resolved_cache_endpoint())
    return PrefixCache(ident, Snapshot.decode, client, l1_max_bytes=int(cfg.l1_cache_gb * (1 << 30)),
                       l1_max_entries=cfg.l1_cache_entries, every=cfg.cache_every,
                       l2_max_bytes=int(cfg.l2_cache_gb * (1 << 30)))


class RefreshView:
    """A PrefixCache seen by a "refresh" job: never restores, stores this prompt's snapshots."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def boundaries(self, n_prompt: int) -> list[int]:
        return self.cache.boundaries(n_prompt)

    def lookup(self, ids: Sequence[int]) -> None:
        return None

    def insert(self, ids: Sequence[int], snap: Any) -> None:
        self.cache.insert(ids, snap)


def for_policy(cache: PrefixCache | None, policy: str) -> Any:
    """What the engine gets as prefix_cache= for a job's policy (use, bypass, refresh)."""
    if cache is None or policy == "bypass":
        return None
    return RefreshView(cache) if policy == "refresh" else cache


def cache_stats(cfg: DaemonConfig, cache: PrefixCache | None, remote: dict | None) -> dict[str, Any]:
    """The `cache` map of the worker's stats: hits, hit tokens, bytes per tier, evictions, L2 up."""
    if not cfg.cache:
        return {"enabled": False}
    out: dict[str, Any] = {"enabled": True, "endpoint": cfg.resolved_cache_endpoint(), "l2_up": remote is not None}
    # one stats() call: one consistent set of counters, taken under the cache's lock (this runs
    # on the socket thread while the engine and writer threads go on counting)
    local = cache.stats(remote=False) if cache is not None else None
    if local is not None:
        out.update({k: local[k] for k in ("lookups", "misses", "inserts", "l2_writes", "l2_dropped_writes",
                                           "l2_lost_writes", "l2_discarded_writes", "l2_evicted_in_l1",
                                           "l2_unanswered_writes", "l2_store_changed", "l2_too_large",
                                           "corrupt_dropped", "mismatch_dropped")})
        out["l1"], out["l2"] = dict(local["l1"]), dict(local["l2"])
        out["hits"] = local["l1"]["hits"] + local["l2"]["hits"]
        out["hit_tokens"] = local["l1"]["hit_tokens"] + local["l2"]["hit_tokens"]
    if remote is not None:
        l2 = out.setdefault("l2", {})
        l2.update(bytes=remote.get("bytes", 0), entries=remote.get("entries", 0),
                  evictions=remote.get("evictions", 0))
        out["position_lists"] = remote.get("position_lists", 0)
        out["l2_process"] = remote
        out["notes"] = [recovery_note(n) for n in remote.get("recoveries", ())]
    return out


def recovery_note(n: dict) -> str:
    """One status line for a damaged L2 store the cache process moved aside and recreated."""
    return damaged_store_line(n, f"L2 {n.get('store')} store")
