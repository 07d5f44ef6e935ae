"""dflash from Python, as a new user meets it: DFlashClient and AsyncDFlashClient against a real
daemon (real supervisor and worker processes, real ipc sockets, a tiny real model), checking that
each misuse ends in the documented exception with one clear line, that nothing hangs past the
time it was given, and that no socket outlives its use."""

from __future__ import annotations

import asyncio
import gc
import math
import tempfile
import threading
import time
import warnings

import pytest
from daemon_fixtures import PROMPTS, make_daemon, running, tiny_pair, wait_until  # noqa: F401

from dflash.client import (
    AsyncDFlashClient,
    BadRequestError,
    ClientClosedError,
    DFlashClient,
    Delta,
    NotFoundError,
    Result,
    WorkerGoneError,
    WorkerUnavailableError,
)


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


@pytest.fixture
def client(daemon):
    with daemon.client(timeout=20) as c:
        yield c


def _nowhere() -> str:
    """An ipc endpoint nothing listens on."""
    return f"ipc://{tempfile.mkdtemp(prefix='dfl', dir='/tmp')}/none.sock"


def _unclosed_sockets(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning) and "socket" in str(w.message)]


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert text and "\n" not in text, text
    return text


# ---------------------------------------------------------------------------- streams


def test_a_stream_is_an_iterator_and_a_second_loop_yields_nothing(client):
    """`stream()` is documented as an iterator of Delta: next() works on it, and a second loop
    over a finished stream ends at once (it re-sent the submit on a closed socket: ZMQError)."""
    s = client.stream(PROMPTS[0], max_tokens=12)
    assert iter(s) is s
    first = next(s)
    rest = list(s)
    assert isinstance(first, Delta) and isinstance(s.result, Result)
    assert [t for d in (first, *rest) for t in d.token_ids] == s.result.token_ids
    assert list(s) == [] and s.result.finish_reason == "length"


def test_breaking_out_of_a_stream_cancels_its_job_at_once(client):
    """"Leaving the loop early cancels the job": at once, not when a garbage collection (or the
    worker's full send queue) gets to the abandoned stream."""
    gc.disable()
    try:
        for _ in client.stream(PROMPTS[0], max_tokens=8000):
            break
        wait_until(lambda: not client.jobs(), 1.0, "the job to be cancelled")
    finally:
        gc.enable()


def test_a_stream_not_iterated_holds_no_socket_and_sends_nothing(client):
    """A stream is sent when first iterated; one dropped (or closed) before that left its
    socket to the garbage collector (ResourceWarning: unclosed socket)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            client.stream(PROMPTS[1], max_tokens=4)
        gc.collect()
    assert _unclosed_sockets(caught) == []
    s = client.stream(PROMPTS[1], max_tokens=4)
    s.close()
    assert list(s) == [] and s.result is None
    with pytest.raises(NotFoundError):
        client.status(s.job_id)  # never queued


def test_a_daemon_stopped_mid_stream_is_worker_gone_and_the_job_is_kept(make_daemon, tiny_pair):  # noqa: F811
    """`dflashd stop` while a job streams: the job is kept and runs again when asked for, which
    is WorkerGoneError's promise; it was a JobFailedError ("could not produce a result")."""
    d = make_daemon()
    c = d.client(timeout=30)
    s = c.stream(PROMPTS[2], max_tokens=1000)
    next(s)
    with d.client(timeout=10) as control:
        control.shutdown()
    with pytest.raises(WorkerGoneError) as e:
        list(s)
    assert e.value.code == "shutting_down" and e.value.job_id == s.job_id
    assert f"result {s.job_id}" in _one_line(e.value)
    d.proc.wait(30)
    d.start()
    res = c.job(e.value.job_id).result(timeout=120)
    assert res.finish_reason == "length" and len(res.token_ids) == 1000
    c.close()


# ---------------------------------------------------------------------------- settings, endpoints


@pytest.mark.parametrize("make", [DFlashClient, AsyncDFlashClient])
def test_client_settings_are_checked_when_the_client_is_made(make):
    """A timeout of -1 made every call fail at once as "no worker answered"; a string one failed
    later with a bare `unsupported operand` TypeError."""
    for bad in (-1, 0, math.nan, math.inf):
        for name in ("timeout", "heartbeat_timeout", "retry_interval"):
            with pytest.raises(ValueError, match=name):
                make("ipc:///tmp/x.sock", **{name: bad})
    with pytest.raises(TypeError, match="timeout"):
        make("ipc:///tmp/x.sock", timeout="5")
    with pytest.raises(TypeError, match="endpoint"):
        make(5)


@pytest.mark.parametrize("make", [DFlashClient, AsyncDFlashClient])
def test_an_empty_endpoint_is_refused_not_taken_for_the_default(make, monkeypatch):
    """`DFlashClient(endpoint="")` (an unset variable passed on) went to DFLASH_ENDPOINT or the
    config's endpoint, another daemon than the caller meant; the CLI refuses `--endpoint ""` too."""
    monkeypatch.setenv("DFLASH_ENDPOINT", "ipc:///tmp/elsewhere.sock")
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="empty"):
            make(empty)
    c = make(None)  # None still means the environment's, then the config's
    try:
        assert c.endpoint == "ipc:///tmp/elsewhere.sock"
    finally:
        c.close()


def test_a_bad_timeout_for_one_call_is_refused(client):
    for bad in (0, -5, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            client.stats(timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        client.job("x").result(timeout=-1)
    assert client.stats(timeout=5)["state"] == "ready"


def test_a_malformed_endpoint_is_a_bad_request_not_a_zmq_error():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DFlashClient("nonsense") as c, pytest.raises(BadRequestError) as e:
            c.stats()
        assert "'nonsense'" in _one_line(e.value) and "ipc://" in str(e.value)

        async def go():
            async with AsyncDFlashClient("tcp://no-port") as a:
                with pytest.raises(BadRequestError, match="no-port"):
                    await a.stats()
                with pytest.raises(BadRequestError, match="no-port"):
                    await a.generate("hi", max_tokens=2)

        asyncio.run(go())
        gc.collect()
    assert _unclosed_sockets(caught) == []


# ---------------------------------------------------------------------------- closed clients


def test_a_closed_client_says_so(daemon):
    """After close() the client quietly built a new ZeroMQ context that nothing closed again."""
    with daemon.client(timeout=10) as c:
        assert c.stats()["state"] == "ready"
        s = c.stream(PROMPTS[3], max_tokens=4)
    for call in (c.stats, lambda: c.generate("hi", max_tokens=2), lambda: c.submit("hi", max_tokens=2),
                 lambda: list(s)):
        with pytest.raises(ClientClosedError, match="closed"):
            call()
    assert c._ctx is None
    c.close()  # twice is fine


def test_a_closed_async_client_says_so(daemon):
    async def go():
        a = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=10)
        async with a:
            assert (await a.stats())["state"] == "ready"
        for coro in (a.stats, lambda: a.generate("hi", max_tokens=2), lambda: a.status("x")):
            with pytest.raises(ClientClosedError, match="closed"):
                await coro()
        a.close()

    asyncio.run(go())


def test_closing_a_client_that_another_thread_streams_on(daemon):
    """The streaming threads got a raw `ZMQError: Socket operation on non-socket`."""
    c = daemon.client(timeout=10)
    errors: list[Exception] = []

    def stream() -> None:
        try:
            list(c.stream(PROMPTS[4], max_tokens=4000))  # one runs, one waits in the queue
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    with daemon.client(timeout=10) as other:
        wait_until(lambda: len(other.jobs()) == 2, 30, "both streams' jobs")
        c.close()
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads)
        assert [type(e) for e in errors] == [ClientClosedError] * 2, errors
        wait_until(lambda: not other.jobs(), 30, "the worker to cancel the streams' jobs")


def test_closing_an_async_client_that_tasks_stream_on(daemon):
    """zmq.asyncio cancelled their receives: tasks nobody cancelled got CancelledError. A task
    that is cancelled itself still gets CancelledError, and its job is cancelled."""
    async def go():
        a = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=10)

        async def consume() -> None:
            async for _ in a.stream(PROMPTS[7], max_tokens=4000):
                pass

        cancelled = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        tasks = [asyncio.create_task(consume()) for _ in range(2)]
        await asyncio.sleep(0.5)
        a.close()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)

    assert [type(e) for e in asyncio.run(go())] == [ClientClosedError] * 2
    with daemon.client(timeout=10) as other:
        wait_until(lambda: not other.jobs(), 30, "the worker to cancel the streams' jobs")


# ---------------------------------------------------------------------------- waiting for results


def test_result_waits_no_longer_than_its_timeout_without_a_worker():
    """result(timeout=1) with no daemon returned after the client's own timeout (here 20 s)."""
    with DFlashClient(_nowhere(), timeout=20) as c:
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailableError):
            c.job("abc").result(timeout=1)
        assert time.monotonic() - t0 < 4

    async def go():
        async with AsyncDFlashClient(_nowhere(), timeout=20) as a:
            t0 = time.monotonic()
            with pytest.raises(WorkerUnavailableError):
                await a.result("abc", timeout=1)
            return time.monotonic() - t0

    assert asyncio.run(go()) < 4


def test_result_with_no_time_to_wait_still_looks_once(client, daemon):
    """timeout=0 is "don't wait": a finished job's result came back as ClientTimeoutError."""
    h = client.submit(PROMPTS[5], max_tokens=4)
    done = h.result(timeout=60)
    assert h.result(timeout=0) == done

    async def go():
        async with AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=10) as a:
            return await a.result(h.job_id, timeout=0)

    assert asyncio.run(go()) == done


def test_an_async_stream_with_no_worker_takes_only_its_timeout():
    """It then sent a cancel for the job nothing had accepted, waiting 2 s more."""
    async def go():
        async with AsyncDFlashClient(_nowhere(), timeout=1, retry_interval=0.5) as a:
            t0 = time.monotonic()
            with pytest.raises(WorkerUnavailableError, match="dflashd start"):
                async for _ in a.stream("hi", max_tokens=2):
                    pass
            return time.monotonic() - t0

    assert asyncio.run(go()) < 1.8


# ---------------------------------------------------------------------------- the asyncio flavour


def test_the_async_client_has_the_sync_calls(make_daemon):  # noqa: F811
    """"The asyncio flavour of DFlashClient (same calls, awaited)": `async with`, stats(timeout),
    status(timeout) and shutdown() were missing."""
    d = make_daemon()

    async def go():
        async with AsyncDFlashClient(d.endpoint, config=d.cfg, timeout=10) as a:
            assert (await a.stats(timeout=5))["state"] == "ready"
            jid = await a.submit(PROMPTS[6], max_tokens=3)
            assert len((await a.result(jid, timeout=60)).token_ids) == 3
            assert (await a.status(jid, timeout=5)).state == "done"
            return await a.shutdown(timeout=5)

    assert asyncio.run(go())["shutting_down"] is True
    assert d.proc.wait(30) == 0
