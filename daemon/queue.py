"""The worker's job queue: priorities, FIFO within a priority, a length cap, cancel.

Shared by the socket thread (push, cancel, queries) and the compute thread (pop, finish), so
every method takes the one lock. Jobs are ordered by (-priority, seq); seq comes from the store
and survives restarts, which keeps FIFO order for re-queued jobs.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One accepted generation request and its live state in this worker."""

    job_id: str
    seq: int
    request: dict[str, Any]  # the Submit fields (plain map: persisted as is)
    priority: int = 0
    stream: bool = True
    attempts: int = 0
    deadline_s: float = 600.0
    state: str = "queued"  # queued | running | done | error | cancelled | held (not queued: store.hold)
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    started_at: float = 0.0
    held_at: float = 0.0  # wall time it was first held (persisted), 0 when not held

    def key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)

    def request_cancel(self, reason: str = "cancelled") -> None:
        if not self.cancel.is_set():
            self.cancel_reason = reason
            self.cancel.set()

    def expired(self) -> bool:
        return self.started_at > 0 and time.monotonic() - self.started_at > self.deadline_s


class QueueFull(Exception):
    pass


class JobQueue:
    def __init__(self, max_len: int):
        self.max_len = max_len
        self._heap: list[tuple[tuple[int, int], str]] = []
        self._jobs: dict[str, Job] = {}  # queued and running
        self._running: Job | None = None
        self._cv = threading.Condition()
        self._closed = False

    def push(self, job: Job, force: bool = False) -> int:
        """Queue a job and return its position; QueueFull when at the cap (force: re-queue)."""
        with self._cv:
            if not force and self.queued_count() >= self.max_len:
                raise QueueFull(f"queue full ({self.max_len} jobs waiting)")
            self._jobs[job.job_id] = job
            heapq.heappush(self._heap, (job.key(), job.job_id))
            self._cv.notify()
            return self._position_locked(job)

    def pop(self, timeout: float | None = None) -> Job | None:
        """Next job to run (it becomes the running job); None on timeout or when closed. A closed
        queue starts nothing more: its queued jobs stay stored and run at the next start. (It
        used to hand them out until empty: a stop with jobs queued ran them for nobody, past the
        supervisor's 20 s grace, and the kill then charged a crash attempt to a job that had none.)"""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                while self._heap and not self._closed:
                    _, jid = heapq.heappop(self._heap)
                    job = self._jobs.get(jid)
                    if job is not None and job.state == "queued":
                        job.state = "running"
                        job.started_at = time.monotonic()
                        self._running = job
                        return job
                if self._closed:
                    return None
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cv.wait(left)

    def finish(self, job: Job, state: str) -> None:
        with self._cv:
            job.state = state
            self._jobs.pop(job.job_id, None)
            if self._running is job:
                self._running = None

    def cancel(self, job_id: str, reason: str = "cancelled") -> Job | None:
        """Cancel a queued job (removed now) or a running one (stops within one cycle)."""
        with self._cv:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            job.request_cancel(reason)
            if job.state == "queued":
                job.state = "cancelled"
                self._jobs.pop(job_id, None)  # its heap entry is skipped by pop()
                self._compact()
            return job

    def _compact(self) -> None:
        """(Lock held.) Drop cancelled jobs' heap entries once they outnumber the live ones.
        pop() skips them only when it reaches them: while one long job runs, clients that queue
        and cancel (or disconnect) grew the heap without bound, since max_queue counts only the
        queued jobs (scripts/soak.py)."""
        if len(self._heap) > 2 * len(self._jobs) + 64:
            self._heap = [e for e in self._heap if (j := self._jobs.get(e[1])) is not None and j.state == "queued"]
            heapq.heapify(self._heap)

    def get(self, job_id: str) -> Job | None:
        with self._cv:
            return self._jobs.get(job_id)

    def position(self, job_id: str) -> int:
        with self._cv:
            job = self._jobs.get(job_id)
            return -1 if job is None else self._position_locked(job)

    def _position_locked(self, job: Job) -> int:
        if job.state == "running":
            return 0
        ahead = sum(1 for j in self._jobs.values() if j.state == "queued" and j.key() < job.key())
        return ahead + (1 if self._running is not None else 0)

    def queued_count(self) -> int:
        with self._cv:
            return sum(1 for j in self._jobs.values() if j.state == "queued")

    @property
    def running(self) -> Job | None:
        return self._running

    def sizes(self) -> dict[str, int]:
        """Jobs tracked (queued and running) and heap entries (cancelled ones wait there until
        popped past), read-only for the worker's stats: both return to 0 when idle."""
        with self._cv:
            return {"jobs": len(self._jobs), "heap": len(self._heap)}

    def snapshot(self) -> list[Job]:
        """Running job first, then queued jobs in run order."""
        with self._cv:
            queued = sorted((j for j in self._jobs.values() if j.state == "queued"), key=Job.key)
            return ([self._running] if self._running else []) + queued

    def close(self) -> None:
        with self._cv:
            self._closed = True
            if self._running is not None:
                self._running.request_cancel("shutdown")
            self._cv.notify_all()
