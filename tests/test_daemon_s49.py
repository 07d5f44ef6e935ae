"""Session 49: the worker's queue against real daemons on the tiny pair, over real sockets.

- A detached job (stream false) that a second connection re-attached to (the same submit sent
  again with stream true) was cancelled when that connection went away.
- A different request that reused the id of an unfinished job was answered `accepted` for the
  other job and then streamed that job's text as its own: it is refused (bad_request, job_id).
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from dflash.daemon import protocol as P

from daemon_fixtures import raw_request, running, tiny_pair, wait_until  # noqa: F401 (tiny_pair: a fixture)

LONG = 4000  # the tiny pair decodes for many seconds: long enough to act while it runs


@pytest.fixture(scope="module")
def daemon(tiny_pair):
    yield from running(tiny_pair, max_queue=8, heartbeat_s=0.2)


class Conn:
    """A raw DEALER connection (what any client is to the worker's ROUTER)."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, **msg) -> None:
        self.sock.send(msgpack.packb({"v": P.VERSION, **msg}, use_bin_type=True))

    def recv(self, timeout_ms: int = 10_000) -> dict:
        assert self.sock.poll(timeout_ms), "no reply"
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def until(self, *types: str, timeout_s: float = 30.0) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            m = self.recv()
            if m["type"] in types:
                return m
        raise AssertionError(f"no {types} in {timeout_s}s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def req(daemon, **msg) -> dict:
    return raw_request(daemon.endpoint, {"v": P.VERSION, "rid": 1, **msg})


def state(daemon, job_id: str) -> dict:
    return req(daemon, op="status", job_id=job_id)


def cancel_and_wait(daemon, job_id: str) -> None:
    req(daemon, op="cancel", job_id=job_id)
    wait_until(lambda: state(daemon, job_id).get("state") not in ("queued", "running"), 30, f"{job_id} to end")


def test_detached_job_outlives_a_reattached_stream_that_vanishes(daemon):
    sub = dict(op="submit", text="Tell me a long story about the sea.", max_tokens=LONG, job_id="s49-detached")
    assert req(daemon, **sub, stream=False)["type"] == "accepted"
    wait_until(lambda: state(daemon, "s49-detached")["state"] == "running", 30, "the detached job to start")
    watcher = Conn(daemon.endpoint)
    try:
        watcher.send(**sub, rid=5, stream=True)  # re-attach: stream it here
        assert watcher.recv()["type"] == "accepted"
        got = watcher.until("delta", "heartbeat")
        assert got["rid"] == 5
    finally:
        watcher.close()  # gone without a cancel
    before = req(daemon, op="stats")["data"]["clients_gone"]
    wait_until(lambda: req(daemon, op="stats")["data"]["clients_gone"] > before, 10, "the worker to see it gone")
    time.sleep(0.5)
    st = state(daemon, "s49-detached")
    # before: state cancelled, result finish_reason cancelled, though no one cancelled it
    assert st["state"] == "running", st
    cancel_and_wait(daemon, "s49-detached")


def test_streamed_job_still_ends_with_its_connection(daemon):
    owner = Conn(daemon.endpoint)
    try:
        owner.send(op="submit", rid=2, text="Count the waves.", max_tokens=LONG, job_id="s49-streamed", stream=True)
        assert owner.recv()["type"] == "accepted"
        owner.until("delta")
    finally:
        owner.close()
    wait_until(lambda: state(daemon, "s49-streamed")["state"] == "cancelled", 10, "the streamed job to be cancelled")


def test_reused_job_id_with_another_request_is_refused(daemon):
    first = dict(op="submit", text="Describe a lighthouse at night.", max_tokens=LONG, job_id="s49-dup", stream=False)
    assert req(daemon, **first)["type"] == "accepted"
    # queued behind it, also unfinished
    second = dict(op="submit", text="Name three birds.", max_tokens=16, job_id="s49-dup-q", stream=False)
    assert req(daemon, **second)["type"] == "accepted"
    try:
        for job_id, other in (("s49-dup", {"text": "Something else entirely."}),
                              ("s49-dup", {"max_tokens": 8}),
                              ("s49-dup-q", {"text": "Name three fish."})):
            base = first if job_id == "s49-dup" else second
            r = req(daemon, **{**base, **other})
            # before: accepted, and the other request's job (its text) given as this one's
            assert r["type"] == "error" and r["code"] == P.BAD_REQUEST and r["param"] == "job_id", r
            assert job_id in r["message"] and "different request" in r["message"]
        # the same submit sent again (its reply lost) still answers for the job it queued
        again = req(daemon, **first)
        assert again["type"] == "accepted" and again["job_id"] == "s49-dup"
        streamed = Conn(daemon.endpoint)
        try:  # re-sent with stream true (the client's retry of a lost reply): same fields, accepted
            streamed.send(**{**second, "stream": True}, rid=3)
            assert streamed.recv()["type"] == "accepted"
        finally:
            streamed.close()
        jobs = [j["job_id"] for j in req(daemon, op="jobs")["data"]["jobs"]]
        assert jobs.count("s49-dup") == 1 and jobs.count("s49-dup-q") == 1
    finally:
        cancel_and_wait(daemon, "s49-dup")
        wait_until(lambda: state(daemon, "s49-dup-q").get("state") not in ("queued", "running"), 60, "s49-dup-q")
    # finished: the id is free for a new request (its result is answered, as before)
    assert req(daemon, **{**second, "text": "Name three fish."})["type"] == "accepted"


def test_a_cancel_after_the_last_token_leaves_the_answer_whole(daemon):
    """A cancel sent on seeing the last delta (a client that stops reading there, a Ctrl-C at
    the end) reaches a job whose engine has finished: it used to turn the whole answer into
    finish_reason "cancelled" (39 of 40 times), state cancelled, jobs_cancelled + 1."""
    canceller = Conn(daemon.endpoint)
    wrong = []
    try:
        for i in range(12):
            owner = Conn(daemon.endpoint)
            try:
                owner.send(op="submit", rid=1, text=f"Prompt {i} about the tide", max_tokens=6,
                           job_id=f"s49-late{i}", stream=True)
                got = 0
                while True:
                    m = owner.recv()
                    if m["type"] == "delta":
                        got += len(m["token_ids"])
                        if got >= 6:
                            canceller.send(op="cancel", rid=100 + i, job_id=f"s49-late{i}")
                    if m["type"] in ("done", "error"):
                        break
                assert m["type"] == "done", m
                if len(m["token_ids"]) == 6 and m["finish_reason"] != "length":
                    wrong.append((i, m["finish_reason"], m["stats"]["finish_reason"]))
                assert m["finish_reason"] == m["stats"]["finish_reason"]
            finally:
                owner.close()
    finally:
        canceller.close()
    assert not wrong, wrong
    assert state(daemon, "s49-late0")["state"] == "done"


def test_a_cancel_or_time_limit_mid_answer_still_says_so(daemon):
    owner = Conn(daemon.endpoint)
    try:
        owner.send(op="submit", rid=1, text="A long tale of ships.", max_tokens=LONG, job_id="s49-mid", stream=True)
        owner.until("delta")
        assert req(daemon, op="cancel", job_id="s49-mid")["data"]["cancelled"] is True
        done = owner.until("done")
        assert done["finish_reason"] == "cancelled" and 0 < len(done["token_ids"]) < LONG
        owner.send(op="submit", rid=2, text="A long tale of ships.", max_tokens=LONG, job_id="s49-limit",
                   stream=True, timeout_s=0.5)
        done = owner.until("done")
        assert done["finish_reason"] == "timeout" and 0 < len(done["token_ids"]) < LONG
    finally:
        owner.close()
    assert state(daemon, "s49-mid")["state"] == "cancelled"
