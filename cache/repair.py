"""Opening a diskcache store that may be damaged: check it, move a damaged one aside, salvage.

A truncated or overwritten `cache.db` made every start of the cache process fail ("database disk
image is malformed"), so the supervisor restarted it forever and L2 stayed down. Now a store
whose sqlite file is damaged is renamed `NAME.damaged-<time>` (kept, untouched, for inspection),
a fresh store is created in its place, and the entries that can still be read (rows sqlite can
still reach, value files that name their own key) are copied into it after a check. An intact
store is never moved. A note in the kept folder (`RECOVERY.json`) lets status report it.

Reading the kept file never writes to it (`immutable=1`). A file cut short (`truncate -s 50%`)
records more pages in its header than it has, which sqlite refuses outright; `writable_schema`
makes it read the pages that are there instead, and a scan that meets a broken or missing page
resumes at the next rowid it can reach (`_rows`), so the rows on intact pages come back.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import diskcache

NOTE = "RECOVERY.json"
_DAMAGE_CODES = (11, 26)  # SQLITE_CORRUPT ("malformed"), SQLITE_NOTADB ("not a database")
_ROWS = "SELECT rowid, key, filename, value FROM Cache WHERE rowid > ? AND raw = 1 ORDER BY rowid"
_NEXT = "SELECT rowid FROM Cache WHERE rowid > ? ORDER BY rowid LIMIT 1"
_MIN_ROWID, _MAX_ROWID = -(1 << 63), (1 << 63) - 1

log = logging.getLogger("dflash.cache.repair")

# (key from a readable row or None for a bare value file, value) -> the key to keep it under, or None
Keep = Callable[[str | None, bytes], str | None]


def is_damage(e: BaseException) -> bool:
    """True for sqlite errors that mean the file itself is bad (not locked, full or unreadable)."""
    return isinstance(e, sqlite3.DatabaseError) and (getattr(e, "sqlite_errorcode", 0) & 0xFF) in _DAMAGE_CODES


def damage(db: Path) -> str:
    """Why the sqlite file `db` is unusable, or "" when it is intact (or absent)."""
    if not db.exists():
        return ""
    try:
        con = sqlite3.connect(db)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        if is_damage(e):
            return str(e)
        raise  # locked, I/O error...: not a reason to throw the store away
    return "" if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:3])


def open_store(path: Path, keep: Keep, *, label: str, **settings: Any) -> tuple[diskcache.Cache, dict | None]:
    """The diskcache store at `path`, and the recovery note when it had to be recreated. `label`
    names the store in the log ("job store", "L2 snapshot store")."""
    reason = damage(path / "cache.db")
    if not reason:
        try:
            return diskcache.Cache(str(path), **settings), None
        except sqlite3.DatabaseError as e:
            if not is_damage(e):
                raise
            reason = str(e)
    aside = _move_aside(path)
    log.error("%s %s is damaged (%s): moved aside to %s, creating a fresh one", label, path, reason, aside)
    cache = diskcache.Cache(str(path), **settings)
    # The note goes in before the salvage too: a process stopped while salvaging (tens of seconds
    # for a full store) left a copy that no status reported and nothing ever deleted.
    note = dict(store=path.name, reason=reason, moved_to=str(aside), salvaged="not all",
                at=time.strftime("%Y-%m-%d %H:%M:%S"))
    (aside / NOTE).write_text(json.dumps(note))
    note["salvaged"] = _salvage(aside, cache, keep)
    (aside / NOTE).write_text(json.dumps(note))
    log.error("%s %s recreated; %d readable entries salvaged from %s", label, path, note["salvaged"], aside)
    return cache, note


def notes(directory: Path) -> list[dict]:
    """Recovery notes of the damaged stores still kept under `directory`, oldest first."""
    out = []
    for f in sorted(directory.glob(f"*.damaged-*/{NOTE}")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            out.append(dict(store=f.parent.name, moved_to=str(f.parent), reason="?", salvaged=0, at="?"))
    return out


def remove_orphans(cache: diskcache.Cache) -> int:
    """Delete value files that no row of `cache` names; how many. diskcache writes the file
    before its row, so a kill -9 mid-write (or writes into a store removed while serving) left
    files that nothing reads, that no size limit counts and that nothing ever deleted. Only
    files of diskcache's own layout (`xx/yy/<hex>.val`) are touched."""
    root = Path(cache.directory)
    named = {f for (f,) in cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    removed = freed = 0
    for f in root.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val"):
        if f.relative_to(root).as_posix() in named or not f.is_file():
            continue
        try:
            size = f.stat().st_size
            f.unlink()
        except OSError as e:
            log.warning("could not remove orphan value file %s: %s", f, e)
            continue
        removed, freed = removed + 1, freed + size
    if removed:
        log.warning("%s: removed %d value files (%d bytes) that no entry named", root, removed, freed)
    return removed


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    path.rename(aside)
    os.chmod(aside, 0o700)  # it may come from a version that made stores 0755
    return aside


def _salvage(aside: Path, cache: diskcache.Cache, keep: Keep) -> int:
    """Copy every entry of the damaged store that `keep` accepts into `cache`; how many."""
    kept = 0
    for key, value in _entries(aside):
        k = keep(key, value)
        if k is None or k in cache:
            continue
        try:
            cache.set(k, value, retry=True)
        except Exception as e:  # e.g. a full disk: keep what is in, serve
            log.warning("salvage stopped: %s", e)
            break
        kept += 1
    return kept


def _entries(aside: Path) -> Iterator[tuple[str | None, bytes]]:
    """(key, value) of the rows sqlite can still read, then (None, value) of other value files."""
    seen: set[str] = set()
    try:  # immutable: read the kept file as it is, write nothing next to it
        con = sqlite3.connect(f"{(aside / 'cache.db').resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            con.execute("PRAGMA writable_schema = ON")  # a short file: read the pages it has
            for key, filename, value in _rows(con):
                if filename:
                    seen.add(filename)
                    value = _read(aside / filename)
                if isinstance(key, str) and isinstance(value, bytes):
                    yield key, value
        finally:
            con.close()
    except sqlite3.Error as e:
        log.warning("salvage: rows unreadable (%s); scanning value files", e)
    for f in sorted(aside.rglob("*.val"), key=lambda f: f.stat().st_mtime):  # oldest first: LRU order
        if str(f.relative_to(aside)) not in seen and (value := _read(f)) is not None:
            yield None, value


def _rows(con: sqlite3.Connection) -> Iterator[tuple[Any, Any, Any]]:
    """(key, filename, value) of each row sqlite can reach, in rowid order; a scan that meets a
    broken page goes on past it (`_past`) instead of ending there."""
    after: int | None = _MIN_ROWID
    while after is not None:
        try:
            for rowid, key, filename, value in con.execute(_ROWS, (after,)):
                after = rowid
                yield key, filename, value
            return
        except sqlite3.DatabaseError:
            after = _past(con, after)


def _past(con: sqlite3.Connection, after: int) -> int | None:
    """A rowid bound beyond `after` from which a scan reads again (None: nothing beyond reads):
    probe in doubling steps until one reads, then bisect back to the first bound that does."""
    def reads(bound: int) -> bool:
        try:
            con.execute(_NEXT, (bound,)).fetchall()
            return True
        except sqlite3.DatabaseError:
            return False

    bad, step = after, 1
    while not reads(good := min(bad + step, _MAX_ROWID)):
        if good == _MAX_ROWID:
            return None
        bad, step = good, step * 2
    while good - bad > 1:
        mid = (bad + good) // 2
        bad, good = (bad, mid) if reads(mid) else (mid, good)
    return good


def _read(f: Path) -> bytes | None:
    try:
        return f.read_bytes()
    except OSError:
        return None
