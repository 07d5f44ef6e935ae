"""The on-disk cache over weeks of daily use (session 48): real tiny MLX models, real cache
processes, real diskcache folders on disk.

Proves: a model named as the config names it (`~/models/x`, a Hugging Face repo id) is
fingerprinted from the folder it was loaded from, so new weights there (a fine-tune saved over
it, a new revision in the HF cache) miss the old weights' snapshots and cached output equals
uncached output; a write that fails on a full disk leaves no value file behind (the folder's
bytes on disk stay what the store counts), nor does one whose database write fails; a full disk
logs one line for a run of failed writes, not one per snapshot, and one when writes work again;
a full disk still serves every stored entry (a get's LRU update is a write); a store that cannot
be opened on a full disk says so in one line (exit 1, a reason for status), not a traceback; an
entry whose value file was deleted outside dflash is dropped, not counted on; a lowered size
limit frees the disk at the next start.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_l2 import CacheProc, blob, cache_proc, key  # noqa: F401  (fixture)

from dflash.cache.tiers import PrefixCache
from dflash.daemon.caching import pair_identity
from dflash.daemon.supervisor import REASON_ENV
from dflash.engine import tiny
from dflash.engine.prefix import Snapshot
from helpers import run_dflash

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."


def _build(d: Path, seed: int, draft: Path) -> None:
    """A tiny target; its draft (one, kept unchanged: only the target's weights change) once."""
    tiny.build_target(d, "qwen3", seed=seed)
    if not draft.exists():
        tiny.build_draft(draft, d)


def _rewrite(d: Path, seed: int, draft: Path) -> None:
    """New weights over the old ones: same config, same file sizes, a later modification time."""
    weights = sorted(d.glob("*.safetensors"))
    times = [f.stat().st_mtime_ns for f in weights]
    _build(d, seed, draft)
    for f, t in zip(weights, times):
        if f.stat().st_mtime_ns == t:  # coarse file-system clocks
            os.utime(f, ns=(t, t + 1_000_000_000))


def _cached_equals_plain(name: str, draft: Path, proc: CacheProc, rebuild) -> None:
    from dflash.engine.loading import load_pair

    pair = load_pair(name, draft)
    ids = pair.tokenizer.encode(PROMPT)
    pc = PrefixCache(pair_identity(pair, None), Snapshot.decode, proc.client(), every=16)
    run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12, prefix_cache=pc)
    assert pc.flush()
    old = pair_identity(pair, None)

    rebuild()
    new = load_pair(name, draft)
    assert pair_identity(new, None).digest() != old.digest()
    plain, _ = run_dflash(new.target, new.drafter, new.tokenizer, ids, 12)
    fresh = PrefixCache(pair_identity(new, None), Snapshot.decode, proc.client(), every=16)
    cached, _ = run_dflash(new.target, new.drafter, new.tokenizer, ids, 12, prefix_cache=fresh)
    assert cached.stats.cached_prompt_tokens == 0  # the old weights' K/V is not this model's
    assert cached.token_ids == plain.token_ids


def test_new_weights_under_a_home_relative_model_path_miss_the_old_snapshots(
        tmp_path, monkeypatch, cache_proc):  # noqa: F811
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = tmp_path / "home" / "models" / "tiny"
    draft = tmp_path / "draft"
    _build(model, 0, draft)
    monkeypatch.chdir(tmp_path)  # the daemon's folder: "~/models/tiny" names nothing under it
    _cached_equals_plain("~/models/tiny", draft, cache_proc(), lambda: _rewrite(model, 7, draft))


def test_a_new_revision_in_the_hf_cache_misses_the_old_revisions_snapshots(
        tmp_path, monkeypatch, cache_proc):  # noqa: F811
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    snaps = hub / "models--tinyorg--tiny-qwen3" / "snapshots"
    draft = tmp_path / "draft"
    _build(snaps / "rev1", 0, draft)
    monkeypatch.chdir(tmp_path)

    def new_revision() -> None:
        _build(snaps / "rev2", 7, draft)
        later = time.time() + 10
        os.utime(snaps / "rev2", (later, later))  # the newest snapshot is the one loaded

    _cached_equals_plain("tinyorg/tiny-qwen3", draft, cache_proc(), new_revision)


def _small_files() -> None:  # the child sees "file too large" (EFBIG) past 1 MiB, like a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def _value_files(store: Path) -> list[Path]:
    return [p for p in (store / "snapshots").rglob("*.val")]


def test_failed_writes_leave_no_value_file_behind(tmp_path):
    proc = CacheProc(tmp_path / "l2", preexec_fn=_small_files).start()
    try:
        c = proc.client()
        assert c.put(key(1), blob(1, 100_000), wait=True)
        kept = _value_files(proc.directory)
        assert len(kept) == 1
        for i in range(10, 16):  # every prompt's snapshots on a full disk
            assert not c.put(key(i), blob(i, 3 << 20), wait=True)
        assert _value_files(proc.directory) == kept  # no partial 1 MiB file per failed write
        stats = c.stats()
        assert stats["write_errors"] == 6 and stats["entries"] == 1
        assert sum(f.stat().st_size for f in kept) <= stats["bytes"]  # on disk = what the budget counts
        assert c.get_first([key(1)]) == (key(1), blob(1, 100_000))
        c.close()
    finally:
        proc.cleanup()


def test_a_failed_database_write_leaves_no_value_file_behind(tmp_path):
    """The value file fits, then sqlite's own write fails (its files are what is full)."""
    proc = CacheProc(tmp_path / "l2", preexec_fn=_small_files).start()
    try:
        c = proc.client()
        i = 0
        while c.put(key(i), blob(i, 20_000), wait=True):  # in-row entries grow the database
            i += 1
            assert i < 500, "the database never filled"
        stored = [k for k in range(1000, 1006) if c.put(key(k), blob(k, 100_000), wait=True)]
        assert len(stored) < 6  # some value files were written, their rows were not
        assert len(_value_files(proc.directory)) == len(stored)  # only those that have a row
        assert c.stats()["entries"] == i + len(stored)
        c.close()
    finally:
        proc.cleanup()


def test_a_full_disk_logs_once_per_run_of_failed_writes(tmp_path):
    proc = CacheProc(tmp_path / "l2", preexec_fn=_small_files, stderr=subprocess.PIPE).start()
    try:
        c = proc.client()
        for i in range(10, 16):
            assert not c.put(key(i), blob(i, 3 << 20), wait=True)
        assert c.put(key(2), blob(2, 100_000), wait=True)  # writes work again
        assert not c.put(key(20), blob(20, 3 << 20), wait=True)  # a new run of failures
        assert c.stats()["write_errors"] == 7
        c.close()
    finally:
        proc.cleanup()
    log = proc.proc.stderr.read().decode()
    failed = [line for line in log.splitlines() if "failed" in line and "write of" in line]
    assert len(failed) == 2, log  # the first of each run, not one per snapshot
    assert "File too large" in failed[0] and "kept in memory" in failed[0]
    assert len([line for line in log.splitlines() if "L2 writes work again, after 6 failed" in line]) == 1, log


def test_an_entry_whose_value_file_was_deleted_outside_dflash_is_dropped(tmp_path):
    """A temp-file cleaner (or `find -atime +30 -delete`) removes value files, not rows."""
    proc = CacheProc(tmp_path / "l2", stderr=subprocess.PIPE).start()
    try:
        c = proc.client()
        for i in range(3):
            assert c.put(key(i), blob(i, 100_000), wait=True)
        full = c.stats()["bytes"]
        files = {f: f.read_bytes() for f in _value_files(proc.directory)}
        gone = [f for f, data in files.items() if key(0).encode() in data or key(1).encode() in data]
        assert len(gone) == 2
        for f in gone:
            f.unlink()
        assert c.get_first([key(0), key(1)]) is None
        stats = c.stats()
        assert stats["entries"] == 1 and stats["missing_files"] == 2  # no longer counted as held
        assert stats["bytes"] <= full - 200_000  # the budget no longer counts bytes not on disk
        assert c.get_first([key(2)]) == (key(2), blob(2, 100_000))
        assert c.put(key(0), blob(0, 100_000), wait=True)  # stored again, served again
        assert c.get_first([key(0)]) == (key(0), blob(0, 100_000))
        c.close()
    finally:
        proc.cleanup()
    log = proc.proc.stderr.read().decode()
    assert len([line for line in log.splitlines() if "is missing" in line]) == 1, log


def _no_files() -> None:  # no file past 1 KiB: sqlite cannot even open its write-ahead log
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_a_store_that_cannot_be_opened_on_a_full_disk_says_why_in_one_line(tmp_path):
    """At every restart (with backoff, for as long as the disk is full) a 20-line traceback and
    no reason for `dflashd status`; now one line, exit 1 (restarted), the reason left."""
    proc = CacheProc(tmp_path / "l2").start()
    try:
        c = proc.client()
        assert c.put(key(1), blob(1, 100_000), wait=True)
        c.close()
    finally:
        proc.stop()
    reason = tmp_path / "reason"
    env = dict(os.environ, **{REASON_ENV: str(reason)})  # as the supervisor starts it
    try:
        for directory in (proc.directory, tmp_path / "fresh"):
            p = subprocess.Popen(_cache_cmd(directory, proc.endpoint), preexec_fn=_no_files, env=env,
                                 stderr=subprocess.PIPE)
            _, err = p.communicate(timeout=60)
            lines = err.decode().strip().splitlines()
            assert p.returncode == 1, err.decode()
            assert len(lines) == 1 and "cannot open the L2 store in" in lines[0], lines
            assert "disk I/O error" in lines[0] or "too large" in lines[0], lines
            assert "cannot open the L2 store" in reason.read_text()
    finally:
        proc.cleanup()
    proc = CacheProc(tmp_path / "l2").start()  # space again: the store is intact
    try:
        c = proc.client()
        assert c.get_first([key(1)]) == (key(1), blob(1, 100_000))
        c.close()
    finally:
        proc.cleanup()


def _cache_cmd(directory: Path, endpoint: str) -> list[str]:
    return [sys.executable, "-m", "dflash.cache.l2", "--dir", str(directory), "--endpoint", endpoint]


def test_a_full_disk_still_serves_every_stored_entry(tmp_path):
    """A get records the entry's use (its LRU time) in a write: once the disk was full, every hit
    was taken for an unreadable entry (a miss, a delete attempted, one warning each)."""
    proc = CacheProc(tmp_path / "l2", preexec_fn=_small_files, stderr=subprocess.PIPE).start()
    try:
        c = proc.client()
        n = 0
        while c.put(key(n), blob(n, 20_000), wait=True):  # until the database is full
            n += 1
            assert n < 500, "the database never filled"
        for r in range(3 * n):
            assert c.get_first([key(r % n)]) == (key(r % n), blob(r % n, 20_000)), r
        stats = c.stats()
        assert stats["entries"] == n and stats["corrupt_dropped"] == 0
        assert stats["hits"] == 3 * n
        c.close()
    finally:
        proc.cleanup()
    log = proc.proc.stderr.read().decode()
    assert "dropping unreadable entry" not in log, log
    assert len([line for line in log.splitlines() if "could not record the use of" in line]) == 1, log


def test_a_lowered_size_limit_frees_the_disk_at_the_next_start(tmp_path):
    """`l2_cache_gb` lowered (the disk ran full): the restart on the same store used to free
    nothing until the next write, and nothing at all while only reads came."""
    proc = CacheProc(tmp_path / "l2", size_limit=4_000_000).start()
    try:
        c = proc.client()
        for i in range(30):
            assert c.put(key(i), blob(i, 100_000), wait=True)
        old_store = c.stats()["store"]
        c.close()
        proc.stop()
        assert sum(f.stat().st_size for f in _value_files(proc.directory)) > 2_900_000

        proc.size_limit = 1_000_000
        proc.start()
        c = proc.client()
        stats = c.stats()
        assert stats["bytes"] <= 1_000_000 and 0 < stats["entries"] < 10
        assert sum(f.stat().st_size for f in _value_files(proc.directory)) <= 1_000_000  # on disk
        assert stats["store"] != old_store  # the worker's in-L2 marks are cleared (they named them)
        assert c.get_first([key(29)]) == (key(29), blob(29, 100_000))  # the most recent are kept
        assert c.get_first([key(0)]) is None
        c.close()
    finally:
        proc.cleanup()
