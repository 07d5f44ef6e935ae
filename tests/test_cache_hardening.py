"""The L2 store under damage, other users and swapped files (issue #13): real cache processes,
real diskcache directories, a real daemon.

Proves: a truncated or garbage sqlite file (snapshots or positions) no longer keeps the cache
process down: the store is moved aside untouched, recreated, readable entries are salvaged, the
log says so and an intact store is never moved; damage found while serving ends the process and
its restart repairs it; the daemon reports a repair in `dflashd status`; every directory and file
of the store is private (0700/0600), also in a pre-existing custom cache_dir; an entry read back
under another key (two value files swapped) is a miss, removed and logged, never restored.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_fixtures import PROMPTS, make_daemon, tiny_pair, wait_until  # noqa: F401
from test_l2 import CacheProc, blob, cache_proc, key  # noqa: F401

from dflash.cache.l2 import start_cache_process
from dflash.cache.positions import PositionStore
from dflash.cache.tiers import Identity, PrefixCache
from dflash.engine.prefix import Snapshot
from helpers import run_dflash

BIG, SMALL = 60_000, 100  # diskcache keeps values >= 32 KiB in files, smaller ones in sqlite rows


def _fill(proc: CacheProc) -> None:
    c = proc.client()
    for i in range(8):
        assert c.put(key(i), blob(i, BIG if i % 2 == 0 else SMALL), wait=True)
    assert PositionStore(c).put("doc", [0, 1, 2, 40])
    c.close()


def _damage(db: Path, how: str) -> bytes:
    if how == "truncate":  # what `truncate -s 50% cache.db` does
        os.truncate(db, db.stat().st_size // 2)
    else:
        db.write_bytes(b"this is not a database\n" * 200)
    return db.read_bytes()


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


@pytest.mark.parametrize("store,how", [("snapshots", "truncate"), ("snapshots", "garbage"),
                                       ("positions", "garbage")])
def test_damaged_store_is_moved_aside_and_recreated(cache_proc, tmp_path, store, how):  # noqa: F811
    log = open(tmp_path / "cache.log", "wb")
    proc = cache_proc(stderr=log)
    _fill(proc)
    proc.stop()
    damaged = _damage(proc.directory / store / "cache.db", how)

    proc.start()  # before the fix: "database disk image is malformed", exit, restart, forever
    c = proc.client()
    st = c.stats()
    [note] = st["recoveries"]
    assert note["store"] == store and note["salvaged"] >= 0
    assert ("malformed" if how == "truncate" else "not a database") in note["reason"]
    aside = Path(note["moved_to"])
    assert aside.parent == proc.directory and aside.name.startswith(f"{store}.damaged-")
    assert (aside / "cache.db").read_bytes() == damaged  # kept untouched for inspection
    text = (tmp_path / "cache.log").read_text()
    assert "is damaged" in text and "moved aside" in text and "salvaged" in text

    if store == "snapshots":
        assert note["salvaged"] >= 4  # the value files name their key: all four came back intact
        for i in range(0, 8, 2):
            assert c.get_first([key(i)]) == (key(i), blob(i, BIG))
        assert PositionStore(c).get("doc") == [0, 1, 2, 40]  # the other store was left alone
    else:
        assert PositionStore(c).list() == []  # nothing readable: a fresh, working store
        assert c.get_first([key(0)]) == (key(0), blob(0, BIG))
    assert c.put(key(20), blob(20, BIG), wait=True) and PositionStore(c).put("new", [3])
    assert proc.proc.poll() is None
    c.close()

    proc.stop()  # an intact store is never moved again; the kept copy is still reported
    proc.start()
    c = proc.client()
    assert c.stats()["recoveries"] == [note]
    assert sorted(p.name for p in proc.directory.iterdir() if ".damaged-" in p.name) == [aside.name]
    assert c.get_first([key(20)]) == (key(20), blob(20, BIG)) and PositionStore(c).get("new") == [3]
    c.close()
    log.close()


def test_truncated_store_keeps_the_entries_that_are_left(cache_proc, tmp_path):  # noqa: F811
    """`truncate -s 50%` of a store of small (in-row) snapshots: the rows on the pages that are
    left come back intact (before: sqlite refused the short file and none did)."""
    proc = cache_proc(stderr=open(tmp_path / "cache.log", "wb"))
    c = proc.client()
    for i in range(300):
        assert c.put(key(i), blob(i, SMALL), wait=True)
    c.close()
    proc.stop()
    _damage(proc.directory / "snapshots" / "cache.db", "truncate")

    proc.start()
    c = proc.client()
    [note] = c.stats()["recoveries"]
    got = {i: c.get_first([key(i)]) for i in range(300)}
    kept = [i for i, hit in got.items() if hit is not None]
    assert 0 < len(kept) == note["salvaged"] < 300
    assert all(got[i] == (key(i), blob(i, SMALL)) for i in kept)
    assert f"L2 snapshot store {proc.directory / 'snapshots'} is damaged" in (tmp_path / "cache.log").read_text()
    c.close()


def test_damage_found_while_serving_is_repaired_by_a_restart(cache_proc, tmp_path):  # noqa: F811
    proc = cache_proc(stderr=open(tmp_path / "cache.log", "wb"))
    _fill(proc)
    for name in ("cache.db", "cache.db-wal"):  # overwritten in place under the running process
        f = proc.directory / "snapshots" / name
        with open(f, "r+b") as fh:
            fh.write(b"\xa5" * f.stat().st_size)
    c = proc.client()
    assert not c.put(key(9), blob(9, SMALL), wait=True)
    assert proc.proc.wait(10) == 1  # ends itself instead of failing every request
    assert "exiting so that a restart repairs it" in (tmp_path / "cache.log").read_text()

    proc.start()
    # the old client's first calls may time out while it reconnects to the new process (its
    # timeout is 1 s, a slow VM's restart can take longer): ask until it answers
    deadline = time.monotonic() + 20
    while (st := c.stats()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [n["store"] for n in st["recoveries"]] == ["snapshots"]
    assert c.get_first([key(2)]) == (key(2), blob(2, BIG))  # salvaged from its value file
    c.close()


def test_store_is_private_even_in_a_preexisting_custom_dir(tmp_path):
    custom = tmp_path / "custom"  # a cache_dir the user made: 0755
    custom.mkdir()
    os.chmod(custom, 0o755)
    nested = tmp_path / "made" / "by" / "us"
    for d in (custom, nested):
        proc = CacheProc(d, preexec_fn=lambda: os.umask(0o022))  # the usual login umask
        try:
            proc.start()
            _fill(proc)
            modes = _modes(d)  # while running: the WAL and shm files exist too
            assert any(p.endswith(".val") for p in modes) and "snapshots/cache.db-wal" in modes
            proc.stop()
            modes.update(_modes(d))
        finally:
            proc.cleanup()
        loose = {p: oct(m) for p, m in modes.items()
                 if m != (0o700 if p == "." or (d / p).is_dir() else 0o600)}
        assert not loose, f"readable by others in {d}: {loose}"
    assert stat.S_IMODE((tmp_path / "made").stat().st_mode) == 0o700  # parents we created too


def test_an_entry_read_under_another_key_is_a_miss(pairs, cache_proc, tmp_path):  # noqa: F811
    pair = pairs("qwen3")
    proc = cache_proc(stderr=open(tmp_path / "cache.log", "wb"))
    a = pair.tokenizer.encode("Question: what is the capital of France? Answer: Paris is. " * 2)
    b = a[::-1]  # same token count, other tokens: the two snapshots have the same size
    ident = Identity(pair.model_path, pair.draft_path, tuple(pair.drafter.layer_ids))

    def gen(ids, cache):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 16, prefix_cache=cache)
        return final

    pc = PrefixCache(ident, Snapshot.decode, proc.client(), every=4096)  # one snapshot a prompt
    cold = [gen(ids, pc) for ids in (a, b)]
    assert pc.flush()
    files = sorted((proc.directory / "snapshots").rglob("*.val"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2 and files[0].stat().st_size == files[1].stat().st_size
    one, two = files[0].read_bytes(), files[1].read_bytes()
    files[0].write_bytes(two)
    files[1].write_bytes(one)

    fresh = PrefixCache(ident, Snapshot.decode, proc.client(), every=4096)  # a restarted worker
    for ids, ref in zip((a, b), cold):
        got = gen(ids, fresh)
        assert got.stats.cached_prompt_tokens == 0  # before the fix: all of them, wrong state
        assert got.token_ids == ref.token_ids
    st = proc.client().stats()
    assert st["corrupt_dropped"] == 2 and st["hits"] == 0
    assert "another key" in (tmp_path / "cache.log").read_text()
    assert fresh.flush() and proc.client().stats()["entries"] == 2  # re-stored, each under its key


def test_daemon_repairs_a_damaged_store_and_status_says_so(make_daemon):  # noqa: F811
    d = make_daemon(start=False, cache_every=16)
    db = d.dir / "state" / "cache" / "snapshots" / "cache.db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"garbage\n" * 1000)
    d.start()
    with d.client(timeout=30) as c:
        end = time.monotonic() + 30
        while not c.stats()["cache"]["l2_up"]:
            assert time.monotonic() < end, d.logs()
            time.sleep(0.2)
        assert len(c.generate(PROMPTS[0], max_tokens=4).token_ids) == 4
        notes = c.stats()["cache"]["notes"]
    assert len(notes) == 1 and "snapshots store was damaged (file is not a database)" in notes[0]
    sup = json.loads((d.dir / "run" / "supervisor.json").read_text())
    assert sup["children"]["cache"]["restarts"] == 0  # before the fix: restarted with backoff, forever
    assert "moved aside" in d.logs()
    out = subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "status", "--runtime-dir",
                          str(d.dir / "run"), "--state-dir", str(d.dir / "state")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cache L2 up" in out.stdout and "cache note" in out.stdout
    assert str(d.dir / "state" / "cache" / "snapshots.damaged-") in out.stdout
    modes = _modes(d.dir / "state" / "cache")  # the kept copy is ours (0700), its files as they were
    loose = {p: oct(m) for p, m in modes.items() if m not in (0o700, 0o600) and not (".damaged-" in p and "/" in p)}
    assert not loose and stat.S_IMODE((d.dir / "state").stat().st_mode) == 0o700


def _unusable(tmp_path: Path, how: str) -> Path:
    """A cache_dir that cannot hold a store, made `how`."""
    blocker = tmp_path / "afile"
    if how == "under_a_file":  # NotADirectoryError on mkdir
        blocker.write_text("not a folder\n")
        return blocker / "sub"
    if how == "store_is_a_file":  # the snapshots/ store named by a file
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "snapshots").write_text("not a folder\n")
        return tmp_path / "c"
    os.symlink(tmp_path / "loop", tmp_path / "loop")  # ELOOP
    return tmp_path / "loop" / "sub"


@pytest.mark.parametrize("how", ["under_a_file", "store_is_a_file", "symlink_loop"])
def test_unusable_cache_dir_exits_2_with_one_line(tmp_path, how):
    """docs/cache.md: an unusable cache_dir ends the cache process with rc 2 (not restarted),
    saying why in one log line. Before: a NotADirectoryError traceback and rc 1, restarted."""
    directory = _unusable(tmp_path, how)
    proc = CacheProc(directory)  # its short ipc path
    try:
        proc.proc = start_cache_process(directory, proc.endpoint, 1 << 20, stderr=subprocess.PIPE)
        _, err = proc.proc.communicate(timeout=30)
    finally:
        proc.cleanup()
    lines = err.decode().strip().splitlines()
    assert proc.proc.returncode == 2, err.decode()
    assert len(lines) == 1 and f"cannot use {directory} as the cache directory" in lines[0], lines


def test_daemon_does_not_restart_a_cache_process_on_an_unusable_dir(make_daemon, tmp_path):  # noqa: F811
    (tmp_path / "afile").write_text("not a folder\n")
    d = make_daemon(cache_dir=str(tmp_path / "afile" / "sub"))
    wait_until(lambda: "cache exited with 2; not restarting" in d.logs(), 30, "the cache process to exit 2")
    time.sleep(1.0)  # a restart would come after restart_backoff_s (0.2 s)
    logs = d.logs()
    assert "Traceback" not in logs and "cache died" not in logs, logs
    assert logs.count("cannot use") == 1, logs
    with d.client(timeout=30) as c:  # the worker serves from L1
        assert len(c.generate(PROMPTS[0], max_tokens=4).token_ids) == 4
