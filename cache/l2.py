"""L2: the cache process. A ZeroMQ ROUTER serving a diskcache store of snapshot bytes.

Run it as `python -m dflash.cache.l2 --dir DIR --endpoint ipc://...` (or `start_cache_process`).
It never imports MLX: it stores, verifies and serves the worker's encoded snapshots, and the
named sparse-prefill position lists. diskcache (sqlite + files, WAL) makes the store survive
restarts of either process and a kill -9 mid-write (an interrupted write leaves no row).

Wire (one msgpack header frame, then an optional raw payload frame):
    request  {"v": 1, "id": int, "op": str, ...}             reply {"v": 1, "id": int, "ok": bool,
    ops: ping, get {keys: [str]} -> first present intact       "code": str, ...} [+ payload]
         put {key, ack} + payload -> {evicted: [str]}, delete {key}, stats, clear,
         pos_put {name, positions}, pos_get {name}, pos_list, pos_delete {name}
Every reply to a parsed request carries `store`: the id of the snapshot store it was served from.
The id is made at random when the store is created (fresh, or recreated after damage) and kept in
the store's own sqlite file (so a restart on the same store keeps it); a `clear` makes a new one.
The worker counts L1 entries as in L2 only under the id they were stored or read under: another id
means the store is not the one they are in (cache/marks.py).
A put with ack=False gets no reply. A put's reply, ok or not, lists the keys evicted to make room
for it (`evicted`), so that the worker stops counting its L1 copies of them as stored in L2; a
reply without the list (an `internal` error) means the worker cannot know what is still stored.
A write that fails (a full disk) leaves no value file behind and is logged once per run of
failures (then counted in `write_errors`); a row whose value file was deleted outside dflash is
dropped at its next lookup (`missing_files`).
Position lists are stored with a crc32 (`_pack_positions`): a damaged one is absent, never
another list. Bad frames get an error reply (or are dropped when no reply is possible); nothing a
client sends stops the process.
Snapshots are other users' prompts' KV state: everything this process creates is private (umask
077; the store directories are chmod 0700 even when they already existed). A damaged store is
moved aside and recreated at start-up (cache/repair.py); damage found while serving ends the
process so that its restart does that, and so does a store removed or replaced under it (`rm -rf
cache_dir`: writes would go on into the deleted database). Eviction is exact: before a write, the
least recently used entries it needs room from, never the entry itself. Each of these exits (1: restart me, 2: a cache_dir a
restart won't fix, 3: another cache process holds the store) leaves its reason for a supervisor
(daemon/supervisor.py `write_exit_reason`), which shows it in `dflashd start` and `status`.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import fcntl
import logging
import os
import secrets
import signal
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, NoReturn

import diskcache
import msgpack
import zmq

from dflash.daemon.paths import ipc_path, private_dir, secure_ipc_socket
from dflash.daemon.supervisor import write_exit_reason

from . import repair, snapshot
from .snapshot import CorruptSnapshot

PROTOCOL_VERSION = 1
DEFAULT_SIZE_LIMIT = 16 << 30
DEFAULT_MAX_MESSAGE = 16 << 30
MAX_POSITIONS = 1 << 22
MAX_NAME = 200
SNAP_PREFIX = "snap:"
_POS_MAGIC = b"DFPL"  # a stored position list: magic | u32 crc32(list) | the list, msgpack
_LRU = "SELECT key FROM Cache WHERE key != ? ORDER BY access_time LIMIT 10"
_READ_ROW = "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1"
_FILE_OF = "SELECT filename FROM Cache WHERE key = ? AND raw = 1"
_ROWS_NAMING = "SELECT COUNT(*) FROM Cache WHERE filename = ?"
_DROP_ROW = "DELETE FROM Cache WHERE key = ? AND raw = 1"  # diskcache's triggers keep count and size
# The store's id lives in the store's own sqlite file, next to diskcache's tables: it goes with
# that file (a fresh or repaired store has none yet, and gets a new one), and only with it.
_ID_TABLE = ("CREATE TABLE IF NOT EXISTS DflashStore "
             "(one INTEGER PRIMARY KEY CHECK (one = 1), id TEXT NOT NULL)")
# Errors opening cache_dir that may pass (space freed, descriptors closed): a restart may help.
_PASSING = {errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM}

log = logging.getLogger("dflash.cache.l2")


class BytesOnlyDisk(diskcache.Disk):
    """A diskcache Disk that stores only str keys and bytes values: nothing is ever pickled."""

    def put(self, key):
        if type(key) is not str:
            raise TypeError("cache keys must be str")
        return super().put(key)

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if type(value) is not bytes or read:
            raise TypeError("cache values must be bytes")
        return super().store(value, read, key=key)

    def fetch(self, mode, filename, value, read):
        if mode == diskcache.core.MODE_PICKLE:
            raise TypeError("refusing to unpickle a cache value")
        return super().fetch(mode, filename, value, read)

    written: str | None = None  # full path of the value file the last store() began

    def _write(self, full_path, iterator, mode, encoding=None):
        """diskcache's write, minus what a failed one left: a value file cut short by a full
        disk (ENOSPC, EFBIG) stayed on disk, named by no row, outside the size limit, until the
        next start-up's orphan sweep; each failed write of a full disk left another."""
        self.written = full_path
        try:
            return super()._write(full_path, iterator, mode, encoding)
        except FileExistsError:  # never ours: diskcache's names are random, opened with "x"
            raise
        except BaseException:
            _remove(full_path)
            raise


class Store:
    """The two diskcache stores: snapshots (LRU within a byte budget) and position lists."""

    def __init__(self, directory: str | Path, size_limit: int = DEFAULT_SIZE_LIMIT):
        directory = private_dir(Path(directory).absolute())
        self.snaps, _ = repair.open_store(
            directory / "snapshots", _snapshot_key, label="L2 snapshot store",
            disk=BytesOnlyDisk,
            size_limit=size_limit,
            eviction_policy="least-recently-used",
            # diskcache's own cull drops 10 entries whenever the store is over budget, the
            # entry just written included; `_make_room` evicts exactly what the budget needs.
            cull_limit=0,
        )
        # Position lists are user data, not a cache: never evicted.
        self.positions, _ = repair.open_store(
            directory / "positions", _positions_key, label="position-list store", disk=BytesOnlyDisk,
            eviction_policy="none",
        )
        for sub in ("snapshots", "positions"):  # stores made by older versions were 0755
            private_dir(directory / sub)
        self.recoveries = repair.notes(directory)  # damaged stores kept for inspection
        self.counters = dict(
            hits=0, misses=0, puts=0, corrupt_dropped=0, write_errors=0, evictions=0,
            bad_requests=0, too_large=0, orphans_removed=0, missing_files=0,
            unrecorded_reads=0,
        )
        for cache in (self.snaps, self.positions):
            self.counters["orphans_removed"] += repair.remove_orphans(cache)
        self._failing = 0  # writes failed since the last one that worked (logged once)
        self._unrecorded = 0  # reads whose use could not be recorded since the last that could
        self._homes = {d: _identity(d / "cache.db") for d in (directory / "snapshots",
                                                               directory / "positions")}
        self.id = _store_id(self.snaps)  # in every reply: the worker's in-L2 marks hold under it
        self._trim()

    def _trim(self) -> None:
        """Evict down to the size limit at start-up: a limit lowered since the store was filled
        (`l2_cache_gb` 20 -> 5 on a disk that ran full) used to free nothing until the next
        write, and nothing at all while only reads came. A new id when anything went: the
        worker's in-L2 marks may name what was evicted (module doc)."""
        if self.snaps.volume() <= self.snaps.size_limit:
            return
        before = self.snaps.volume()
        evicted: list[str] = []
        try:
            self._make_room(0, keep="", evicted=evicted)
        except Exception as e:  # a full disk may fail the deletes too: the next write tries again
            if repair.is_damage(e):
                raise
            log.warning("could not evict down to the size limit at start-up: %s", e)
        if evicted:
            self.renew_id()
            log.warning("the store held %d bytes, over its size limit of %d: evicted %d least "
                        "recently used snapshots", before, self.snaps.size_limit, len(evicted))

    def renew_id(self) -> None:
        """A new id, kept in the store: its contents are no longer what they were (a clear)."""
        self.id = _store_id(self.snaps, renew=True)

    def gone(self) -> str:
        """Why this store's files are no longer the ones on disk ("" while they are): a removed
        or replaced cache_dir would otherwise take writes into a deleted database, lost at the
        next start, with value files outside any budget."""
        for d, ident in self._homes.items():
            if _identity(d / "cache.db") != ident:
                return f"{d / 'cache.db'} was removed or replaced while serving"
        return ""

    def get_first(self, keys: list[str]) -> tuple[str, bytes] | None:
        """The first of `keys` that holds an intact snapshot; corrupt ones are deleted."""
        for key in keys:
            try:
                data = self.snaps.get(key, default=None, retry=True)
                self._unrecorded = 0
            except Exception as e:
                if repair.is_damage(e):
                    raise  # the database itself: the server stops, a restart recreates it
                try:  # a get is a write too (its LRU time): a full disk failed every hit
                    data = self._read_unrecorded(key, e)
                except Exception:  # unreadable file or row: treat like corruption
                    log.warning("dropping unreadable entry %s: %s", key, e)
                    self._drop(key)
                    continue
            if data is None:
                self._drop_if_fileless(key)
                continue
            reason = snapshot.verify(data, key)
            if reason:
                log.warning("dropping corrupt entry %s: %s", key, reason)
                self._drop(key)
                continue
            self.counters["hits"] += 1
            return key, data
        self.counters["misses"] += 1
        return None

    def _read_unrecorded(self, key: str, why: Exception) -> bytes | None:
        """The value of `key` read without recording its use, after diskcache's get failed: that
        get updates the entry's LRU time in a write transaction, which a full disk fails
        ("disk I/O error", "database or disk is full"). Every hit was then taken for an
        unreadable entry: a miss, a delete attempted, a warning per entry per lookup. Raises
        when the entry cannot be read either. Logged once per run of such reads."""
        row = self.snaps._sql(_READ_ROW, (key,)).fetchone()
        if row is None:
            return None
        data = self.snaps.disk.fetch(row[0], row[1], row[2], False)
        self.counters["unrecorded_reads"] += 1
        self._unrecorded += 1
        if self._unrecorded == 1:
            log.warning("could not record the use of %s (%s; a full disk?): entries are served "
                        "without updating their LRU order until that works again; not logged again "
                        "meanwhile (unrecorded_reads)", key, why)
        return data

    def _drop_if_fileless(self, key: str) -> None:
        """A row whose value file is gone (deleted outside dflash: a temp-file cleaner, a `find
        -delete` of old files) reads as a miss in diskcache, and its row stayed: counted in the
        store's bytes and entries, asked for by every lookup of that prefix, evicted last in
        its turn. Drop the row; log the first such drop, count them all (`missing_files`)."""
        try:
            row = self.snaps._sql(_FILE_OF, (key,)).fetchone()
            if row is None or not row[0] or os.path.exists(os.path.join(self.snaps.directory, row[0])):
                return
            self.snaps._sql(_DROP_ROW, (key,))
        except Exception:
            return
        self.counters["missing_files"] += 1
        if self.counters["missing_files"] == 1:
            log.warning("the value file of %s is missing (deleted outside dflash?): entry dropped; "
                        "further ones are counted (missing_files), not logged", key)

    def _drop(self, key: str) -> None:
        """Delete a bad entry; its value file too, unless another row names that file (a damaged
        index: this row points at another entry's file, which deleting it lost as well)."""
        self.counters["corrupt_dropped"] += 1
        try:
            row = self.snaps._sql(_FILE_OF, (key,)).fetchone()
            if row is not None and row[0] and self.snaps._sql(_ROWS_NAMING, (row[0],)).fetchone()[0] > 1:
                self.snaps._sql(_DROP_ROW, (key,))  # the file stays with the row it belongs to
            else:
                self.snaps.delete(key, retry=True)
        except Exception:
            pass

    def put(self, key: str, data: bytes, evicted: list[str] | None = None) -> str:
        """Store one snapshot; return "" or an error code (writes fail soft). The keys evicted to
        make room are appended to `evicted` (also when the write then fails): the worker's L1
        must stop counting those entries as in L2, or it drops them later without spilling."""
        if not key.startswith(SNAP_PREFIX) or len(key) > 256:
            return "bad_key"
        if snapshot.verify(data, key):  # intact, and bound to this key
            return "corrupt_value"
        if len(data) > self.snaps.size_limit:  # it would evict everything, itself included
            log.warning("snapshot %s is %d bytes, over the L2 size limit of %d: not stored",
                        key, len(data), self.snaps.size_limit)
            self.counters["too_large"] += 1
            return "too_large"
        disk = self.snaps.disk
        disk.written = None
        try:
            # before writing: the disk never holds more
            self._make_room(len(data), keep=key, evicted=evicted)
            self.snaps.set(key, data, retry=True)
            self._make_room(0, keep=key, evicted=evicted)  # sqlite pages may have grown
        except Exception as e:  # ENOSPC, EFBIG, sqlite "database or disk is full", ...
            if repair.is_damage(e):
                raise
            self._unnamed(disk.written)
            self.counters["write_errors"] += 1
            self._write_failing(key, e)
            return "write_failed"
        self.counters["puts"] += 1
        if self._failing:
            log.warning("L2 writes work again, after %d failed", self._failing)
            self._failing = 0
        return ""

    def _write_failing(self, key: str, e: Exception) -> None:
        """Log the first failure of a run of failed writes, with what it means; count the rest.
        A full disk failed every snapshot write of every prompt, one warning line each."""
        self._failing += 1
        if self._failing == 1:
            log.warning("write of %s failed: %s. Snapshots are kept in memory (L1) only while L2 "
                        "writes fail; further failures are counted (write_errors in `dflash-client "
                        "cache show`), not logged, until one succeeds", key, e)

    def _unnamed(self, path: str | None) -> None:
        """Remove the value file a failed set wrote in full when no row names it (the database
        insert after it failed: "database or disk is full"); diskcache leaves it behind."""
        if not path:
            return
        try:
            name = os.path.relpath(path, self.snaps.directory)
            named = self.snaps._sql(_ROWS_NAMING, (name,)).fetchone()[0]
        except Exception:
            return  # cannot tell: the orphan sweep at the next start-up decides
        if not named:
            _remove(path)

    def _make_room(self, need: int, keep: str, evicted: list[str] | None = None) -> None:
        """Evict least-recently-used snapshots (never `keep`) until `need` more bytes fit; the
        keys evicted are appended to `evicted`."""
        limit = self.snaps.size_limit
        while self.snaps.volume() + need > limit:
            victims = self.snaps._sql(_LRU, (keep,)).fetchall()  # diskcache has no public LRU order
            if not victims:
                return
            for (victim,) in victims:
                if self.snaps.volume() + need <= limit:
                    return
                if self.snaps.delete(victim, retry=True):
                    self.counters["evictions"] += 1
                    if evicted is not None:
                        evicted.append(victim)

    def stats(self) -> dict[str, Any]:
        return dict(self.counters, entries=len(self.snaps), bytes=self.snaps.volume(),
                    size_limit=self.snaps.size_limit, position_lists=len(self.positions),
                    recoveries=self.recoveries, store=self.id)

    def close(self) -> None:
        self.snaps.close()
        self.positions.close()


class Server:
    """The request loop: one thread, one ROUTER socket, one Store."""

    def __init__(self, store: Store, endpoint: str, max_message: int = DEFAULT_MAX_MESSAGE):
        self.store = store
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        self.sock.bind(endpoint)
        self.running = True
        self.damaged = ""  # set when a store turns out damaged while serving
        self.gone = ""  # set when the store's files were removed or replaced under it

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while self.running:
            if not poller.poll(200):
                self._check_home()
                continue
            frames = self.sock.recv_multipart(copy=True)
            reply = self.handle(frames)
            if reply is not None:
                try:
                    self.sock.send_multipart(reply, flags=zmq.NOBLOCK, copy=False)
                except zmq.ZMQError:
                    pass  # the peer is gone; nothing to do

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        """One request -> reply frames (None when no reply is due or possible)."""
        if len(frames) < 2:
            self.store.counters["bad_requests"] += 1
            return None
        peer, header, payload = frames[0], frames[1], frames[2:]
        try:
            req = msgpack.unpackb(header, raw=False)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ValueError("header must be a map with an op")
        except Exception:
            self.store.counters["bad_requests"] += 1
            return [peer, _pack({"id": None, "ok": False, "code": "bad_request"})]
        rid = req.get("id")
        try:
            if self._check_home():  # nothing more goes into a store that is no longer on disk
                raise _Gone(self.gone)
            result, blob = self._dispatch(req, payload)
        except _Gone as e:
            result, blob = {"ok": False, "code": "internal", "message": str(e)}, None
        except _BadRequest as e:
            self.store.counters["bad_requests"] += 1
            result, blob = {"ok": False, "code": "bad_request", "message": str(e)}, None
        except Exception as e:  # a store failure is reported, never fatal
            log.exception("request %s failed", req.get("op"))
            result, blob = {"ok": False, "code": "internal", "message": str(e)}, None
            if repair.is_damage(e):  # but a damaged database is repaired by a restart
                self.damaged, self.running = str(e), False
        if req.get("op") == "put" and not req.get("ack", True):
            return None
        out = [peer, _pack(dict(result, id=rid, store=self.store.id))]
        if blob is not None:
            out.append(blob)
        return out

    def _check_home(self) -> bool:
        """Stop serving (to be restarted on a fresh store) once the store's files are gone."""
        if not self.gone and (why := self.store.gone()):
            self.gone, self.running = why, False  # run() logs it and exits 1
        return bool(self.gone)

    def _dispatch(self, req: dict, payload: list[bytes]) -> tuple[dict, bytes | None]:
        op = req["op"]
        st = self.store
        if op == "ping":
            return {"ok": True}, None
        if op == "get":
            keys = req.get("keys")
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise _BadRequest("get needs keys: [str]")
            found = st.get_first(keys)
            if found is None:
                return {"ok": True, "found": False}, None
            return {"ok": True, "found": True, "key": found[0]}, found[1]
        if op == "put":
            key = req.get("key")
            if not isinstance(key, str) or len(payload) != 1:
                raise _BadRequest("put needs key: str and one payload frame")
            evicted: list[str] = []  # reported in the reply, failed or not (see the module doc)
            code = st.put(key, payload[0], evicted)
            return ({"ok": False, "code": code, "evicted": evicted} if code
                    else {"ok": True, "evicted": evicted}), None
        if op == "delete":
            key = _need_str(req, "key")
            return {"ok": True, "deleted": bool(st.snaps.delete(key, retry=True))}, None
        if op == "stats":
            return {"ok": True, "stats": st.stats()}, None
        if op == "clear":
            # the id first: should the clear fail half way, no worker goes on trusting its marks
            st.renew_id()
            st.snaps.clear(retry=True)
            return {"ok": True}, None
        if op.startswith("pos_"):
            return self._positions(op, req), None
        raise _BadRequest(f"unknown op {op!r}")

    def _positions(self, op: str, req: dict) -> dict:
        pos = self.store.positions
        if op == "pos_list":
            return {"ok": True, "names": sorted(pos.iterkeys())}
        name = _need_str(req, "name")
        if not name or len(name) > MAX_NAME:
            raise _BadRequest(f"name must be 1..{MAX_NAME} characters")
        if op == "pos_put":
            values = req.get("positions")
            if (
                not isinstance(values, list)
                or len(values) > MAX_POSITIONS
                or not all(type(p) is int and p >= 0 for p in values)
            ):
                raise _BadRequest(f"positions must be a list of at most {MAX_POSITIONS} ints >= 0")
            try:
                pos.set(name, _pack_positions(values), retry=True)
            except Exception as e:
                self.store.counters["write_errors"] += 1
                return {"ok": False, "code": "write_failed", "message": str(e)}
            return {"ok": True}
        if op == "pos_get":
            data = pos.get(name, default=None, retry=True)
            values = None if data is None else self._position_list(name, data)
            if values is None:
                return {"ok": True, "found": False}
            return {"ok": True, "found": True, "positions": values}
        if op == "pos_delete":
            return {"ok": True, "deleted": bool(pos.delete(name, retry=True))}
        raise _BadRequest(f"unknown op {op!r}")

    def _position_list(self, name: str, data: bytes) -> list[int] | None:
        """The list stored under `name`; a damaged one is dropped and logged (an absent list,
        not an error that reads as "cache process unavailable")."""
        values = _unpack_positions(data)
        if values is not None:
            return values
        log.warning("dropping damaged position list %r (not a list of ints >= 0)", name)
        self.store.counters["corrupt_dropped"] += 1
        self.store.positions.delete(name, retry=True)
        return None

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class _BadRequest(ValueError):
    pass


class _Gone(RuntimeError):
    pass


def _need_str(req: dict, field: str) -> str:
    v = req.get(field)
    if not isinstance(v, str):
        raise _BadRequest(f"{field} must be a string")
    return v


def _pack(msg: dict) -> bytes:
    return msgpack.packb(dict(msg, v=PROTOCOL_VERSION), use_bin_type=True)


def _snapshot_key(key: str | None, data: bytes) -> str | None:
    """Salvage: the key an intact snapshot entry carries (its row's key must agree), or None."""
    try:
        k = snapshot.entry_key(data)
    except CorruptSnapshot:
        return None
    return k if k.startswith(SNAP_PREFIX) and key in (None, k) and not snapshot.verify(data, k) else None


def _positions_key(key: str | None, data: bytes) -> str | None:
    """Salvage: a position list is kept from a readable row whose value is an intact list."""
    return key if key is not None and _unpack_positions(data) is not None else None


def _pack_positions(values: list[int]) -> bytes:
    packed = msgpack.packb(values)
    return _POS_MAGIC + struct.pack("<I", zlib.crc32(packed)) + packed


def _unpack_positions(data: bytes) -> list[int] | None:
    """The list of ints >= 0 a stored value holds; None when it is damaged. Checked: a list with
    one bit flipped is still a list of ints, and it was served as the stored one. Lists stored
    before the check (a bare msgpack list) are read as they are."""
    packed = data
    if data[:4] == _POS_MAGIC:
        packed = data[8:]
        if len(data) < 8 or struct.unpack_from("<I", data, 4)[0] != zlib.crc32(packed):
            return None
    try:
        values = msgpack.unpackb(packed)
    except Exception:
        return None
    ok = isinstance(values, list) and all(type(p) is int and p >= 0 for p in values)
    return values if ok else None


def _store_id(cache: diskcache.Cache, renew: bool = False) -> str:
    """The id kept in `cache`'s sqlite file; made (at random) when it has none, or `renew`."""
    cache._sql(_ID_TABLE)
    row = None if renew else cache._sql("SELECT id FROM DflashStore LIMIT 1").fetchone()
    if row is not None and isinstance(row[0], str) and row[0]:
        return row[0]
    new = secrets.token_hex(8)
    cache._sql("INSERT OR REPLACE INTO DflashStore (one, id) VALUES (1, ?)", (new,))  # one statement
    return new


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of `path`, None when it is missing: tells a replaced file from the same one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _lock(directory: Path):
    """Hold an exclusive lock on the store directory: one cache process per store. The store's
    folders are made here too, so that a cache_dir that cannot hold them fails before serving."""
    for d in (directory, directory / "snapshots", directory / "positions"):
        private_dir(d)
    f = open(directory / "l2.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        _exit(3, f"another cache process holds {directory}")  # the supervisor retries it (backoff) until it is free
    return f  # kept open for the life of the process; the kernel drops it on any exit


def _reason(e: OSError) -> str:
    """An OSError as one short line: its message and the path it concerns, without the errno."""
    if e.strerror is None:
        return str(e)
    return f"{e.strerror}: {e.filename}" if e.filename else e.strerror


def _exit(code: int, reason: str) -> NoReturn:
    """Log why this process exits and leave the reason for its supervisor."""
    log.error("%s", reason)
    write_exit_reason(reason)
    raise SystemExit(code)


def run(directory: str | Path, endpoint: str, size_limit: int = DEFAULT_SIZE_LIMIT) -> None:
    """Serve until SIGTERM/SIGINT (exit 1 when a store turned out damaged: restart to repair)."""
    os.umask(0o077)  # every file and directory this process creates is private
    directory = Path(directory)
    try:
        lock = _lock(directory)
    except OSError as e:
        if e.errno in _PASSING:
            _exit(1, f"cannot open the cache directory {directory} now: {_reason(e)}; exiting to be restarted")
        # another user's, under a file, read-only...: restarting won't help
        _exit(2, f"cannot use {directory} as the cache directory: {_reason(e)}")
    if (sock := ipc_path(endpoint)) is not None:  # an abstract ipc://@name has no file, no folder
        sock.parent.mkdir(parents=True, exist_ok=True)
    try:
        store = Store(directory, size_limit)
    except (OSError, sqlite3.Error) as e:  # damage is repaired inside; this is a full disk, I/O...
        # It used to end in a 20-line traceback at every restart, without a reason for status.
        why = _reason(e) if isinstance(e, OSError) else str(e)
        lock.close()
        _exit(1, f"cannot open the L2 store in {directory} now ({why}; a full disk?): exiting to be "
                 "restarted; the worker serves from memory (L1) meanwhile")
    server = Server(store, endpoint)
    secure_ipc_socket(endpoint)  # its directory is the 0700 runtime dir

    def stop(*_: Any) -> None:  # handlers only set state; the loop notices within 200 ms
        server.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("cache process serving %s on %s", directory, endpoint)
    try:
        server.serve()
    finally:
        server.close()
        store.close()
        lock.close()
    if server.damaged:
        _exit(1, f"L2 store damaged while serving ({server.damaged}); exiting so that a restart repairs it")
    if server.gone:
        _exit(1, f"{server.gone}; exiting so that a restart opens a fresh store")


def start_cache_process(
    directory: str | Path,
    endpoint: str,
    size_limit: int = DEFAULT_SIZE_LIMIT,
    **popen_kwargs: Any,
) -> subprocess.Popen:
    """Start the cache process (a child running this module) and return its Popen."""
    cmd = [sys.executable, "-m", "dflash.cache.l2", "--dir", str(directory),
           "--endpoint", endpoint, "--size-limit", str(size_limit)]
    return subprocess.Popen(cmd, **popen_kwargs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.cache.l2", description="the cache process")
    p.add_argument("--dir", required=True, help="diskcache directory (created if missing)")
    p.add_argument("--endpoint", required=True, help="ZeroMQ endpoint to bind, e.g. ipc://...")
    p.add_argument("--size-limit", type=int, default=DEFAULT_SIZE_LIMIT, help="snapshot bytes")
    p.add_argument("--log-level", default=os.environ.get("DFLASH_CACHE_LOG", "WARNING"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack to the log
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    run(args.dir, args.endpoint, args.size_limit)


if __name__ == "__main__":
    main()
