"""The prompt/KV cache as a demanding daily user meets it: real diskcache stores on disk, real
cache processes, real tiny MLX models.

Proves: a write over the L2 budget evicts only what the budget needs (never the entry just
written, never the whole store) and a snapshot larger than the budget is refused, not written
and then culled with everything else; value files that no entry names (a kill -9 mid-write) are
removed at start-up, other files left alone; a cache_dir removed while the cache process serves
makes it exit 1 with a reason (restarted on a fresh store) instead of writing into a deleted
database; weights rewritten in place (same sizes) miss the old weights' snapshots, so cached
output equals uncached output; a damaged position list reads as absent, not as "cache process
unavailable"; another MLX / BLAS setup misses the snapshots; a full disk leaves no temp file
of the window memory behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from test_l2 import blob, cache_proc, key  # noqa: F401  (fixture)

from dflash.cache.l2 import Store
from dflash.cache.positions import PositionStore
from dflash.cache.tiers import PrefixCache
from dflash.daemon import windowstore
from dflash.daemon.caching import pair_identity
from dflash.engine import tiny
from dflash.engine.prefix import Snapshot
from helpers import run_dflash

ENTRY = 100_000  # over diskcache's 32 KiB: each entry is a value file


def _store(tmp_path: Path, limit: int) -> Store:
    return Store(tmp_path / "l2", size_limit=limit)


def _present(store: Store, i: int) -> bool:
    return key(i) in store.snaps


def test_a_write_over_budget_evicts_only_what_it_needs(tmp_path):
    store = _store(tmp_path, 1_000_000)
    for i in range(8):
        assert store.put(key(i), blob(i, ENTRY)) == ""
    assert store.put(key(99), blob(99, 400_000)) == ""
    assert _present(store, 99)  # diskcache's cull of 10 took the new entry with the rest
    kept = [i for i in range(8) if _present(store, i)]
    assert kept == list(range(8 - len(kept), 8)) and len(kept) >= 4  # the oldest few went
    assert store.snaps.volume() <= 1_000_000
    assert store.stats()["evictions"] == 8 - len(kept)
    store.close()


def test_a_snapshot_over_the_whole_budget_is_refused_and_the_store_kept(tmp_path):
    store = _store(tmp_path, 1_000_000)
    for i in range(5):
        assert store.put(key(i), blob(i, ENTRY)) == ""
    assert store.put(key(50), blob(50, 2_000_000)) == "too_large"
    assert all(_present(store, i) for i in range(5)) and not _present(store, 50)
    st = store.stats()
    assert st["too_large"] == 1 and st["evictions"] == 0 and st["entries"] == 5
    store.close()


def test_orphan_value_files_are_removed_at_start(tmp_path):
    store = _store(tmp_path, 1 << 30)
    for i in range(3):
        store.put(key(i), blob(i, ENTRY))
    snaps = tmp_path / "l2" / "snapshots"
    (val,) = [f for f in snaps.rglob("*.val")][:1]
    orphan = snaps / "ab" / "cd" / "0123456789abcdef0123456789ab.val"  # what kill -9 mid-write leaves
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(val.read_bytes())
    mine = snaps / "notes.txt"  # not diskcache's: never touched
    mine.write_text("keep me")
    store.close()

    store = _store(tmp_path, 1 << 30)
    assert not orphan.exists() and mine.read_text() == "keep me"
    assert store.stats()["orphans_removed"] == 1
    assert all(store.get_first([key(i)]) == (key(i), blob(i, ENTRY)) for i in range(3))
    store.close()


def test_cache_dir_removed_while_serving_exits_1_and_restarts_fresh(cache_proc):  # noqa: F811
    proc = cache_proc()
    c = proc.client()
    assert c.put(key(1), blob(1, ENTRY), wait=True)
    shutil.rmtree(proc.directory)  # `rm -rf ~/.local/state/dflash/cache` with the daemon up
    assert not c.put(key(2), blob(2, ENTRY), wait=True)  # refused, not taken into a deleted db
    assert proc.proc.wait(30) == 1  # the supervisor restarts it on a fresh store
    c.close()

    proc.start()
    c = proc.client()
    assert PositionStore(c).put("doc", [0, 5, 9])
    assert c.put(key(3), blob(3, ENTRY), wait=True)
    proc.stop()
    proc.start()  # what was written after the removal survives a restart
    c = proc.client()
    assert PositionStore(c).get("doc") == [0, 5, 9]
    assert c.get_first([key(3)]) == (key(3), blob(3, ENTRY))
    c.close()


def test_damaged_position_list_is_absent_not_unavailable(cache_proc):  # noqa: F811
    proc = cache_proc()
    c = proc.client()
    store = PositionStore(c, strict=True)
    assert store.put("big", list(range(1000, 21000)))  # 60 KB: a value file
    assert store.put("small", [1, 2, 3])
    (val,) = (proc.directory / "positions").rglob("*.val")
    val.write_bytes(b"\xc1" * 100)  # garbage in place of the list
    assert store.get("big") is None  # was: Unavailable ("the cache process is not available")
    assert store.list() == ["small"] and store.get("small") == [1, 2, 3]
    assert c.stats()["corrupt_dropped"] == 1
    c.close()


def _build(d: Path, seed: int) -> None:
    tiny.build_target(d, "qwen3", seed=seed)
    tiny.build_draft(d / "draft", d)


def test_weights_rewritten_in_place_miss_the_old_snapshots(tmp_path, cache_proc):  # noqa: F811
    from dflash.engine.loading import load_pair

    model = tmp_path / "model"
    _build(model, seed=0)
    proc = cache_proc()
    pair = load_pair(model, model / "draft")
    ids = pair.tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again.")
    pc = PrefixCache(pair_identity(pair, None), Snapshot.decode, proc.client(), every=16)
    run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12, prefix_cache=pc)
    assert pc.flush()

    weights = sorted(model.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in weights]
    old_times = [f.stat().st_mtime_ns for f in weights]
    _build(model, seed=7)  # a fine-tune saved over the model: same config, same file sizes
    assert [f.stat().st_size for f in weights] == sizes
    for f, t in zip(weights, old_times):  # coarse file-system clocks: make "later" visible
        if f.stat().st_mtime_ns == t:
            os.utime(f, ns=(t, t + 1_000_000_000))

    new = load_pair(model, model / "draft")
    plain, _ = run_dflash(new.target, new.drafter, new.tokenizer, ids, 12)
    fresh = PrefixCache(pair_identity(new, None), Snapshot.decode, proc.client(), every=16)
    cached, _ = run_dflash(new.target, new.drafter, new.tokenizer, ids, 12, prefix_cache=fresh)
    assert cached.stats.cached_prompt_tokens == 0  # the old weights' K/V is not this model's
    assert cached.token_ids == plain.token_ids


def _limited_save(state_dir: Path) -> None:
    """windowstore.save in a child whose files may not grow past 64 KiB (EFBIG, like ENOSPC)."""
    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        "from dflash.daemon import windowstore\n"
        "from dflash.engine.window import WindowMemory\n"
        "windowstore.save(Path(sys.argv[1]), 'new-pair', {True: WindowMemory(p=0.5)})\n"
    )
    subprocess.run([sys.executable, "-c", code, str(state_dir)], check=True, timeout=120)


def test_full_disk_leaves_no_window_memory_temp_file(tmp_path):
    pairs = {f"pair-{i}": {"greedy": {"p": 0.5, "d": 1.0}} for i in range(2000)}  # ~150 KB
    path = tmp_path / windowstore.FILE
    path.write_text(json.dumps({"format": windowstore.FORMAT, "pairs": pairs}, indent=1))
    before = path.read_bytes()
    _limited_save(tmp_path)
    assert path.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [windowstore.FILE]  # no partial .tmp


def test_another_blas_or_mlx_setup_misses_the_snapshots(pairs, monkeypatch):
    """Snapshots computed under MKL must not serve a worker on the default BLAS (or another
    MLX version / device): the restored K/V would not be what this worker computes."""
    pair = pairs("qwen3")
    monkeypatch.setenv("DFLASH_ACCEL", "mkl (/x/libmkl_rt.so.2, intel threading)")
    under_mkl = pair_identity(pair, None)
    monkeypatch.setenv("DFLASH_ACCEL", "default BLAS (blas = none)")
    assert pair_identity(pair, None).digest() != under_mkl.digest()
    assert pair_identity(pair, None) == pair_identity(pair, None)  # stable within a setup
