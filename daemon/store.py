"""Durable jobs (diskcache in the state dir): accepted jobs survive a worker crash.

A job record is written before the client hears "accepted", rewritten with attempts+1 when it
starts, and deleted when it finishes, at which point its result (a Done or Error map) is kept
for the retention period. After a crash, `recover` hands back every unfinished job in order;
one that has already been started `max_attempts` times is failed instead of run again. A job
whose client has gone is `hold`-ed: kept (for the retention period) until someone asks for it.

Values are msgpack bytes, never pickle: a record pickled by an older version reads as unreadable
and is dropped. A store SQLite cannot read (a torn or overwritten cache.db) would crash every
worker start: it is opened through cache/repair.py like the L2 stores, so it is moved aside as
`jobs.damaged-<time>` (kept for inspection, with a note `notes` reports) and a fresh one gets
every job and result that can still be read.

One worker per store: the store is locked while open (`<state_dir>/jobs.lock`). A second daemon
on the same state dir (another runtime dir, so the worker and supervisor locks there never met
the first's) recovered the first one's queued jobs as its own and ran them again, on its own
model; now its worker exits 3 with the reason, which its supervisor shows and does not retry.
"""

from __future__ import annotations

import fcntl
import logging
import time
from pathlib import Path
from typing import Any

import diskcache
import msgpack
from diskcache.core import MODE_PICKLE, UNKNOWN

from dflash.cache import repair

from . import protocol as P
from .queue import Job
from .supervisor import write_exit_reason

log = logging.getLogger("dflash.worker")
_JOB = "job:"
_RESULT = "result:"
_SEQ = "seq"


class _MsgpackDisk(diskcache.Disk):
    """diskcache storage that only takes bytes and ints (the seq counter) and never unpickles."""

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> Any:
        if type(value) not in (bytes, int):
            raise TypeError(f"the job store keeps msgpack bytes, not {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str, value: Any, read: bool) -> Any:
        return b"" if mode == MODE_PICKLE else super().fetch(mode, filename, value, read)  # b"": unreadable

    def get(self, key: Any, raw: bool) -> Any:
        return super().get(key, raw) if raw else None  # a pickled key: not ours


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: Any) -> Any:
    """The value of a record, or None when it is missing or unreadable."""
    if not isinstance(data, bytes) or not data:
        return None
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception:  # msgpack raises several unrelated types on bad bytes
        return None


def _keep(key: str | None, data: bytes) -> str | None:
    """Salvage: a job record or result that decodes, under the key its content implies (a bare
    value file has no row to name it; a row's key must agree)."""
    rec = _unpack(data)
    if not isinstance(rec, dict) or not isinstance(rec.get("job_id"), str):
        return None
    implied = (_JOB if "request" in rec else _RESULT) + rec["job_id"]
    return implied if key in (None, implied) else None


class JobStore:
    def __init__(self, directory: str | Path, retention_s: float):
        self.directory = Path(directory)
        self.retention_s = retention_s
        self._lock = _lock(self.directory)  # before repair: a store another worker uses is not ours
        self.cache, note = repair.open_store(self.directory, _keep, label="job store", disk=_MsgpackDisk,
                                             eviction_policy="none")
        if note is not None:
            self._after_salvage(note)

    def notes(self) -> list[dict[str, Any]]:
        """What `repair` noted about damaged job stores still kept beside this one (for status)."""
        return [n for n in repair.notes(self.directory.parent) if n.get("store") == self.directory.name]

    def next_seq(self) -> int:
        return int(self.cache.incr(_SEQ, 1, default=0))

    def save(self, job: Job) -> None:
        self.cache.set(_JOB + job.job_id, _pack(_record(job)))

    def hold(self, job: Job) -> bool:
        """Keep a job nobody waits for until `retention_s` after it was first held; False when
        that time has already run out (across restarts) and the job is dropped instead."""
        job.state, job.held_at = "held", job.held_at or time.time()
        left = job.held_at + self.retention_s - time.time()
        if left > 0:
            self.cache.set(_JOB + job.job_id, _pack(_record(job)), expire=left)
        else:
            self.cache.delete(_JOB + job.job_id)
        return left > 0

    def has_job(self, job_id: str) -> bool:
        """Whether the job's record is still there (a held one expires)."""
        return (_JOB + job_id) in self.cache

    def known(self, job_id: str) -> bool:
        return (_JOB + job_id) in self.cache or (_RESULT + job_id) in self.cache

    def finish(self, job_id: str, result: dict[str, Any]) -> None:
        """Keep the result for the retention period and forget the job record (one transaction)."""
        with self.cache.transact():
            self.cache.set(_RESULT + job_id, _pack(result), expire=self.retention_s)
            self.cache.delete(_JOB + job_id)

    def result(self, job_id: str) -> dict[str, Any] | None:
        return _unpack(self.cache.get(_RESULT + job_id))

    def recover(self, max_attempts: int) -> tuple[list[Job], list[str]]:
        """Unfinished jobs to run again (in queue order), and the ids failed for crashing too often."""
        jobs, failed, dropped = [], [], 0
        for key in list(self.cache.iterkeys()):
            if not (isinstance(key, str) and key.startswith(_JOB)):
                continue
            data = self.cache.get(key)
            if data is None:  # expired meanwhile
                continue
            rec = _unpack(data)
            if not isinstance(rec, dict):  # pickled by an older version, or garbage: never run
                self.cache.delete(key)
                dropped += 1
                continue
            job = Job(
                job_id=rec["job_id"],
                seq=rec["seq"],
                request=rec["request"],
                priority=rec["priority"],
                stream=rec["stream"],
                attempts=rec["attempts"],
                deadline_s=rec["deadline_s"],
                held_at=rec.get("held_at", 0.0),
            )
            if job.attempts >= max_attempts:
                msg = f"job crashed or stopped the worker {job.attempts} times; not retried"
                err = P.to_map(P.Error(code=P.JOB_FAILED, message=msg, job_id=job.job_id))
                self.finish(job.job_id, err)
                failed.append(job.job_id)
            else:
                jobs.append(job)
        if dropped:
            log.warning("dropped %d job record(s) this version cannot read (pickled by an older one)", dropped)
        jobs.sort(key=Job.key)
        return jobs, failed

    def counts(self) -> dict[str, int]:
        """Job records and kept results that have not expired, and all rows (expired ones stay
        until a later write culls them), counted in SQL over the key index: for the stats."""
        now = time.time()
        live = "SELECT COUNT(*) FROM Cache WHERE key >= ? AND key < ? AND (expire_time IS NULL OR expire_time > ?)"
        out = {name: self.cache._sql(live, (prefix, prefix[:-1] + ";", now)).fetchone()[0]  # ";" follows ":"
               for name, prefix in (("jobs", _JOB), ("results", _RESULT))}
        out["rows"] = self.cache._sql("SELECT COUNT(*) FROM Cache").fetchone()[0]
        return out

    def pending_count(self) -> int:
        return sum(1 for k in self.cache.iterkeys() if isinstance(k, str) and k.startswith(_JOB))

    def close(self) -> None:
        self.cache.close()
        self._lock.close()

    def _after_salvage(self, note: dict[str, Any]) -> None:
        """A fresh store just got what could be read of a damaged one: results get a new retention
        period (salvage drops expiry times), seq restarts after the highest kept job."""
        seq, jobs = 0, 0
        for key in list(self.cache.iterkeys()):
            if isinstance(key, str) and key.startswith(_RESULT):
                self.cache.touch(key, expire=self.retention_s)
            elif isinstance(key, str) and key.startswith(_JOB) and isinstance(rec := _unpack(self.cache.get(key)), dict):
                seq, jobs = max(seq, rec["seq"] if isinstance(rec.get("seq"), int) else 0), jobs + 1
        self.cache.set(_SEQ, seq)
        log.warning("job store %s was damaged (%s): moved it to %s; the fresh store kept %d job(s) and %d "
                    "result(s) that could still be read", self.directory, note["reason"], note["moved_to"], jobs,
                    note["salvaged"] - jobs)


def _lock(directory: Path):
    """The open, exclusively locked `<directory>.lock` beside the store (outside it: a damaged
    store is moved aside whole); exit 3 with the reason when another process holds it."""
    directory.parent.mkdir(parents=True, exist_ok=True)  # diskcache makes the store's own
    f = open(directory.parent / f"{directory.name}.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        reason = (f"another worker uses the job store {directory} (a daemon with the same state_dir "
                  "is running): give each daemon its own state_dir")
        log.error("%s", reason)
        write_exit_reason(reason)
        raise SystemExit(3) from None
    return f


def _record(job: Job) -> dict[str, Any]:
    return {"job_id": job.job_id, "seq": job.seq, "request": job.request, "priority": job.priority,
            "stream": job.stream, "attempts": job.attempts, "deadline_s": job.deadline_s, "held_at": job.held_at}
