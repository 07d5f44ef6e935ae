"""The job queue (priority, FIFO, cap, cancel) and its diskcache persistence (crash recovery)."""

from __future__ import annotations

import threading
import time

import pytest

from dflash.daemon import protocol as P
from dflash.daemon.queue import Job, JobQueue, QueueFull
from dflash.daemon.store import JobStore


def _job(i: int, prio: int = 0) -> Job:
    return Job(job_id=f"j{i}", seq=i, request={"text": f"p{i}", "max_tokens": 4}, priority=prio)


def test_priority_then_fifo_and_positions():
    q = JobQueue(max_len=10)
    for i, prio in enumerate([0, 0, 5, -1, 5, 0]):
        q.push(_job(i, prio))
    assert [j.job_id for j in q.snapshot()] == ["j2", "j4", "j0", "j1", "j5", "j3"]
    assert q.position("j2") == 0 and q.position("j3") == 5
    first = q.pop(timeout=0)
    assert first.job_id == "j2" and first.state == "running"
    assert q.position("j2") == 0 and q.position("j4") == 1  # the running job counts as ahead
    order = [first.job_id]
    q.finish(first, "done")
    while (j := q.pop(timeout=0)) is not None:
        order.append(j.job_id)
        q.finish(j, "done")
    assert order == ["j2", "j4", "j0", "j1", "j5", "j3"]


def test_cap_counts_waiting_jobs_only():
    q = JobQueue(max_len=2)
    q.push(_job(0))
    q.push(_job(1))
    with pytest.raises(QueueFull):
        q.push(_job(2))
    q.pop(timeout=0)  # running jobs do not take a queue slot
    q.push(_job(2))
    q.push(_job(3), force=True)  # recovery may exceed the cap
    assert q.queued_count() == 3


def test_cancel_queued_and_running():
    q = JobQueue(max_len=5)
    for i in range(3):
        q.push(_job(i))
    running = q.pop(timeout=0)
    assert q.cancel("j1").state == "cancelled"
    assert q.get("j1") is None and q.position("j1") == -1
    q.cancel(running.job_id)
    assert running.cancel.is_set() and running.state == "running"  # stops at its next cycle
    assert q.cancel("nope") is None
    q.finish(running, "cancelled")
    assert q.pop(timeout=0).job_id == "j2"


def test_pop_blocks_until_push_and_close_wakes():
    q = JobQueue(max_len=5)
    got = []
    t = threading.Thread(target=lambda: got.append(q.pop(timeout=5)))
    t.start()
    time.sleep(0.1)
    q.push(_job(1))
    t.join(2)
    assert got[0].job_id == "j1"
    t = threading.Thread(target=lambda: got.append(q.pop()))
    t.start()
    q.close()
    t.join(2)
    assert got[1] is None


def test_time_limit():
    j = _job(0)
    j.deadline_s = 0.05
    q = JobQueue(5)
    q.push(j)
    q.pop(timeout=0)
    assert not j.expired()
    time.sleep(0.08)
    assert j.expired()


def test_store_recovers_unfinished_jobs_in_order(tmp_path):
    s = JobStore(tmp_path, retention_s=60)
    jobs = [_job(s.next_seq(), prio) for prio in (0, 3, 0)]
    for j in jobs:
        s.save(j)
    jobs[0].attempts = 1  # it was running when the worker died
    s.save(jobs[0])
    s.finish(jobs[2].job_id, P.to_map(P.Done(job_id=jobs[2].job_id, text="x")))
    s.close()

    s2 = JobStore(tmp_path, retention_s=60)  # a new worker process opening the same state dir
    again, failed = s2.recover(max_attempts=3)
    assert [j.job_id for j in again] == [jobs[1].job_id, jobs[0].job_id] and failed == []
    assert again[1].attempts == 1 and again[1].request == jobs[0].request
    assert s2.result(jobs[2].job_id)["text"] == "x"
    assert s2.next_seq() > max(j.seq for j in jobs)  # seq keeps counting: FIFO holds across restarts


def test_store_fails_a_job_after_max_attempts(tmp_path):
    s = JobStore(tmp_path, retention_s=60)
    j = _job(s.next_seq())
    j.attempts = 3
    s.save(j)
    again, failed = s.recover(max_attempts=3)
    assert again == [] and failed == [j.job_id]
    res = s.result(j.job_id)
    assert res["type"] == "error" and res["code"] == P.JOB_FAILED and "3 times" in res["message"]
    assert s.pending_count() == 0


def test_results_expire_after_retention(tmp_path):
    s = JobStore(tmp_path, retention_s=0.2)
    s.finish("j", P.to_map(P.Done(job_id="j")))
    assert s.result("j") is not None and s.known("j")
    time.sleep(0.3)
    assert s.result("j") is None
