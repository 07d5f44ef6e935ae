"""Durable jobs (diskcache in the state dir): accepted jobs survive a worker crash.

A job record is written before the client hears "accepted", rewritten with attempts+1 when it
starts, and deleted when it finishes, at which point its result (a Done or Error map) is kept
for the retention period. After a crash, `recover` hands back every unfinished job in order;
one that has already been started `max_attempts` times is failed instead of run again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diskcache

from . import protocol as P
from .queue import Job

_JOB = "job:"
_RESULT = "result:"


class JobStore:
    def __init__(self, directory: str | Path, retention_s: float):
        self.cache = diskcache.Cache(str(directory), eviction_policy="none")
        self.retention_s = retention_s

    def next_seq(self) -> int:
        return int(self.cache.incr("seq", 1, default=0))

    def save(self, job: Job) -> None:
        record = {
            "job_id": job.job_id,
            "seq": job.seq,
            "request": job.request,
            "priority": job.priority,
            "stream": job.stream,
            "attempts": job.attempts,
            "deadline_s": job.deadline_s,
        }
        self.cache.set(_JOB + job.job_id, record)

    def known(self, job_id: str) -> bool:
        return (_JOB + job_id) in self.cache or (_RESULT + job_id) in self.cache

    def finish(self, job_id: str, result: dict[str, Any]) -> None:
        """Keep the result for the retention period and forget the job record (one transaction)."""
        with self.cache.transact():
            self.cache.set(_RESULT + job_id, result, expire=self.retention_s)
            self.cache.delete(_JOB + job_id)

    def result(self, job_id: str) -> dict[str, Any] | None:
        return self.cache.get(_RESULT + job_id)

    def recover(self, max_attempts: int) -> tuple[list[Job], list[str]]:
        """Unfinished jobs to run again (in queue order), and the ids failed for crashing too often."""
        jobs, failed = [], []
        for key in list(self.cache.iterkeys()):
            if not (isinstance(key, str) and key.startswith(_JOB)):
                continue
            rec = self.cache.get(key)
            if rec is None:
                continue
            job = Job(
                job_id=rec["job_id"],
                seq=rec["seq"],
                request=rec["request"],
                priority=rec["priority"],
                stream=rec["stream"],
                attempts=rec["attempts"],
                deadline_s=rec["deadline_s"],
            )
            if job.attempts >= max_attempts:
                msg = f"job crashed or stopped the worker {job.attempts} times; not retried"
                err = P.to_map(P.Error(code=P.JOB_FAILED, message=msg, job_id=job.job_id))
                self.finish(job.job_id, err)
                failed.append(job.job_id)
            else:
                jobs.append(job)
        jobs.sort(key=Job.key)
        return jobs, failed

    def pending_count(self) -> int:
        return sum(1 for k in self.cache.iterkeys() if isinstance(k, str) and k.startswith(_JOB))

    def close(self) -> None:
        self.cache.close()
