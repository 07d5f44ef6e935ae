"""Session 42's prefix-cache defects, each with the test that failed before its fix.

Proves, with real diskcache stores on disk:
- weights replaced under the same path by a copy that keeps the old files' sizes and modification
  times (`cp -p`, `rsync -a`, `tar x`, a reproducible image build) no longer match the old
  weights' snapshots: the restored K/V was the old model's, and the output not the uncached one;
- a checksum-valid L2 entry whose layer state is not a map (a writer bug) is dropped as corrupt
  and the lookup goes on to the next stored prefix: it used to raise out of the lookup, so the
  request prefilled cold, a shorter stored prefix went unused, and the entry stayed in L2 to
  fail every later lookup of that prompt the same way;
- a second worker on the same state dir (two daemons that share state_dir, each with its own
  runtime dir) exits 3 with the reason instead of recovering the first one's queued jobs as its
  own and running them again; once the first has closed the store, a new worker recovers them;
- an L2 row that names another entry's value file (a damaged index) is a miss that drops only
  that row: dropping it deleted the file too, and with it the other, intact entry;
- a named position list with a flipped bit is absent (dropped, counted), not another list: a list
  of ints with one bit flipped is still a list of ints, and it was served as the stored one;
- a damaged store whose salvage was cut short (the process stopped while copying, tens of seconds
  for a full store) is still reported, with its kept copy: the note was written after the salvage
  only, so that copy was never shown by status, and nothing ever deleted it.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import diskcache
import msgpack
import pytest

from dflash.cache import repair
from dflash.cache import snapshot as fmt
from dflash.cache.l2 import _snapshot_key
from dflash.cache.positions import PositionStore
from dflash.cache.tiers import Identity, PrefixCache
from dflash.daemon import protocol as P
from dflash.daemon.caching import pair_identity
from dflash.daemon.queue import Job
from dflash.daemon.store import JobStore
from dflash.daemon.supervisor import REASON_ENV
from dflash.engine.prefix import Snapshot
from helpers import run_dflash
from test_cache_walkthrough import _build
from test_l2 import blob, cache_proc, key  # noqa: F401  (fixture)

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."


def test_weights_replaced_with_their_old_times_miss_the_old_snapshots(tmp_path, cache_proc):  # noqa: F811
    from dflash.engine.loading import load_pair

    model = tmp_path / "model"
    _build(model, seed=0)
    proc = cache_proc()
    pair = load_pair(model, model / "draft")
    ids = pair.tokenizer.encode(PROMPT)
    pc = PrefixCache(pair_identity(pair, None), Snapshot.decode, proc.client(), every=16)
    run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12, prefix_cache=pc)
    assert pc.flush()

    weights = sorted(model.rglob("*.safetensors"))  # the draft's too
    old = [(f.stat().st_size, f.stat().st_atime_ns, f.stat().st_mtime_ns) for f in weights]
    _build(model, seed=7)  # other weights, same configs, same sizes...
    for f, (size, atime, mtime) in zip(weights, old):
        assert f.stat().st_size == size
        os.utime(f, ns=(atime, mtime))  # ...and the old times, as a copy that keeps them has

    new = load_pair(model, model / "draft")
    plain, _ = run_dflash(new.target, new.drafter, new.tokenizer, ids, 12)
    fresh = PrefixCache(pair_identity(new, None), Snapshot.decode, proc.client(), every=16)
    cached, _ = run_dflash(new.target, new.drafter, new.tokenizer, ids, 12, prefix_cache=fresh)
    assert cached.stats.cached_prompt_tokens == 0  # the old weights' K/V is not this model's
    assert cached.token_ids == plain.token_ids


@pytest.mark.parametrize("state", [1, [1, 2], "kv"])
def test_a_layer_state_that_is_no_map_is_a_corrupt_entry(pairs, cache_proc, state):  # noqa: F811
    pair = pairs("qwen3")
    proc = cache_proc()
    ids = pair.tokenizer.encode(PROMPT * 2)
    plain, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12)
    ident = Identity("target", "draft", (1,))
    pc = PrefixCache(ident, Snapshot.decode, proc.client(), every=16)
    run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12, prefix_cache=pc)
    assert pc.flush()  # every boundary's snapshot is in L2
    whole = pc._keys(ids, [len(ids)])[0]
    body = pc.l1.get(whole).value.body()
    body["target"][-1] = state  # intact bytes, bound to the key, but no cache state
    assert proc.client().put(whole, fmt.encode(body, whole), wait=True)

    fresh = PrefixCache(ident, Snapshot.decode, proc.client(), every=16)
    out, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12, prefix_cache=fresh)
    assert out.token_ids == plain.token_ids
    assert out.stats.cached_prompt_tokens == len(ids) // 16 * 16  # the next stored prefix
    st = fresh.stats()
    assert st["corrupt_dropped"] == 1 and st["lookups"] == 1 and st["l2"]["hits"] == 1
    assert fresh.flush()  # deleted, and replaced by this run's own snapshot of the prompt
    assert Snapshot.decode(proc.client().get_first([whole])[1]).n_tokens == len(ids)


def test_a_second_worker_on_the_same_job_store_exits_3_and_takes_no_job(tmp_path, monkeypatch):
    reason = tmp_path / "reason"
    monkeypatch.setenv(REASON_ENV, str(reason))
    first = JobStore(tmp_path / "jobs", retention_s=60)
    job = Job(job_id="j1", seq=first.next_seq(), request={"prompt": "x"}, priority=0, stream=False)
    first.save(job)  # accepted by the first daemon, still queued there
    with pytest.raises(SystemExit) as e:
        JobStore(tmp_path / "jobs", retention_s=60)
    assert e.value.code == 3
    assert "another worker uses the job store" in reason.read_text()
    assert first.has_job("j1")
    first.close()
    second = JobStore(tmp_path / "jobs", retention_s=60)  # the first one's worker is gone: ours now
    jobs, failed = second.recover(max_attempts=3)
    assert [j.job_id for j in jobs] == ["j1"] and failed == []
    second.finish("j1", P.to_map(P.Done(job_id="j1", text="done")))
    assert second.result("j1")["text"] == "done"
    second.close()


def test_a_row_naming_another_entrys_file_is_dropped_alone(cache_proc):  # noqa: F811
    proc = cache_proc()
    c = proc.client()
    for i in range(3):
        assert c.put(key(i), blob(i, 60_000), wait=True)
    db = proc.directory / "snapshots" / "cache.db"
    with sqlite3.connect(db) as con:  # key(1)'s row now names key(2)'s value file
        con.execute("UPDATE Cache SET filename = (SELECT filename FROM Cache WHERE key = ?) WHERE key = ?",
                    (key(2), key(1)))
    con.close()

    assert c.get_first([key(1)]) is None  # bound to another key: a miss
    st = c.stats()
    assert st["corrupt_dropped"] == 1 and st["entries"] == 2
    assert c.get_first([key(2)]) == (key(2), blob(2, 60_000))  # its file was not deleted with the row
    assert c.get_first([key(0)]) == (key(0), blob(0, 60_000))
    c.close()

    proc.stop()
    proc.start()  # key(1)'s own file, named by no row now, is removed as an orphan
    c = proc.client()
    st = c.stats()
    assert st["orphans_removed"] == 1 and st["entries"] == 2
    assert c.get_first([key(2)]) == (key(2), blob(2, 60_000))
    assert len(list((proc.directory / "snapshots").rglob("*.val"))) == 2
    c.close()


def test_a_position_list_with_a_flipped_bit_is_absent_not_another_list(cache_proc):  # noqa: F811
    proc = cache_proc()
    c = proc.client()
    store = PositionStore(c, strict=True)
    big = list(range(1000, 21000))
    assert store.put("big", big)  # 60 KB: a value file
    assert store.put("small", [1, 2, 3])
    (val,) = (proc.directory / "positions").rglob("*.val")
    data = bytearray(val.read_bytes())
    data[len(data) // 2] ^= 0x01  # bit rot inside one position
    val.write_bytes(bytes(data))
    assert store.get("big") is None  # was: big with one position changed
    assert c.stats()["corrupt_dropped"] == 1
    assert store.list() == ["small"] and store.get("small") == [1, 2, 3]
    assert store.put("big", big) and store.get("big") == big
    c.close()

    proc.stop()
    with diskcache.Cache(str(proc.directory / "positions")) as old:  # a list stored before the check
        old.set("older", msgpack.packb([4, 5, 6]))
    proc.start()  # lists written by this version, and older ones, read back across restarts
    store = PositionStore(proc.client())
    assert store.get("big") == big and store.get("older") == [4, 5, 6]


def test_a_salvage_cut_short_still_reports_the_kept_copy(tmp_path):
    store = tmp_path / "snapshots"
    with diskcache.Cache(str(store)) as c:
        for i in range(4):
            c.set(key(i), blob(i, 60_000))  # value files: salvageable without a row
    (store / "cache.db").write_bytes(b"this is not a database\n" * 200)

    seen = []

    def stopped_after_one(k, data):  # the process is stopped while salvaging
        if seen:
            raise KeyboardInterrupt
        seen.append(k)
        return _snapshot_key(k, data)

    with pytest.raises(KeyboardInterrupt):
        repair.open_store(store, stopped_after_one, label="L2 snapshot store")
    (note,) = repair.notes(tmp_path)  # was: none, and the copy stayed on disk unreported
    assert note["salvaged"] == "not all" and Path(note["moved_to"]).is_dir()
    cache, again = repair.open_store(store, _snapshot_key, label="L2 snapshot store")
    assert again is None and len(cache) == 1  # the fresh store, with what was salvaged, is used
    cache.close()
