"""Session 34's hardening audit: frames the worker cannot take. Each test failed before its fix:
a frame with a non-string map key got an error that said only "ValueError", tied to no request;
a request frame over 16 x max_frame_bytes (which the worker's socket drops unread, with the
connection) left the Python clients re-sending it for their whole timeout and then blaming a
worker that was up ("no dflash worker answered ... is `dflashd start` running?"). Real daemon and
sockets on a tiny model."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
from daemon_fixtures import running, tiny_pair  # noqa: F401

from dflash.client import AsyncDFlashClient, BadRequestError
from dflash.daemon import protocol as P

FRAME = 65536  # the daemon's max_frame_bytes here: its socket drops frames over 16 x this (1 MiB)


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, max_frame_bytes=FRAME)


def _raw(endpoint: str, frame: bytes) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(frame)
        assert sock.poll(10_000), "no reply"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
        ctx.term()


def test_a_frame_with_a_non_string_map_key_says_so_and_names_its_request(daemon):
    frame = msgpack.packb({"v": P.VERSION, "op": "submit", "rid": 77, "text": "hi", "max_tokens": 2,
                           "logit_bias": {1: 5.0}}, use_bin_type=True)
    reply = _raw(daemon.endpoint, frame)
    assert (reply["type"], reply["code"], reply["rid"]) == ("error", P.BAD_FRAME, 77), reply
    assert "map keys must be strings" in reply["message"], reply
    with daemon.client() as c:
        assert c.generate("hi", max_tokens=2).finish_reason in ("stop", "length")


def test_a_frame_the_worker_would_drop_is_refused_as_too_large(daemon):
    huge = "x " * (16 * FRAME // 2 + 1000)  # just over what the socket reads (codec.DROP_FACTOR x FRAME)
    with daemon.client(timeout=5) as c:
        with pytest.raises(BadRequestError) as exc:
            c.generate(huge, max_tokens=2)
        assert exc.value.code == P.TOO_LARGE and f"cap of {FRAME}" in exc.value.message
        with pytest.raises(BadRequestError) as exc:  # a detached submit too
            c.submit(huge, max_tokens=2)
        assert exc.value.code == P.TOO_LARGE
        # one the worker reads and refuses itself: the same error
        with pytest.raises(BadRequestError) as exc:
            c.generate("x " * FRAME, max_tokens=2)
        assert exc.value.code == P.TOO_LARGE
        assert c.generate("hi", max_tokens=2).finish_reason in ("stop", "length")

    async def use_async() -> None:
        a = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=5)
        try:
            with pytest.raises(BadRequestError) as exc:
                await a.generate(huge, max_tokens=2)
            assert exc.value.code == P.TOO_LARGE
            assert (await a.generate("hi", max_tokens=2)).finish_reason in ("stop", "length")
        finally:
            a.close()

    asyncio.run(use_async())
    assert daemon.proc.poll() is None
