"""A half-closed connection: the client sends its whole request, then shuts down its write side
(`shutdown(SHUT_WR)`, a FIN), as some HTTP/1.1 clients and load balancers do, and reads the answer.
asyncio closed the whole connection at the FIN (aiohttp's handler asks nothing else of it), so
such a request got no answer at all. Now the gateway answers every request that arrived before
the FIN (an HTTP/1.1 one after an interim `100 Continue`, its probe for a client that closed
altogether, which is still cancelled), then closes; one whose body the FIN cut short is a 400,
and a connection that asked nothing is closed at once, as before. The tests drive a real
`dflash serve --attach` process on a real daemon (tiny model) over real sockets (the last, a real
aiohttp server in-process), and fail on the code before the change, but for two that hold what
must not change: a connection that asked nothing closes at the FIN, and a client that leaves
still cancels its generation. No mocks."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from daemon_fixtures import tiny_pair  # noqa: F401
from test_adversarial_s47 import daemon, no_eos  # noqa: F401 (module fixtures: a daemon, a bias against end of text)
from test_gateway import Gateway
from test_gateway_s48 import _body, _error, _head, _reply

COMPLETIONS = "/v1/completions"
HEADER_TIMEOUT, BODY_TIMEOUT = 2.0, 8.0
WAIT = 30.0  # seconds a test waits for an answer on a loaded 2-core machine


@pytest.fixture(scope="module")
def gw(daemon):  # noqa: F811
    with Gateway(daemon, "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)) as g:
        yield g


def _half_closed(g, data: bytes) -> socket.socket:
    """A connection that sent `data` and then shut down its write side."""
    s = socket.create_connection(("127.0.0.1", g.port), timeout=WAIT)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    return s


def _rest(s: socket.socket) -> bytes:
    """What `s` still receives until the gateway closes it."""
    got = b""
    try:
        while more := s.recv(65536):
            got += more
    except ConnectionResetError:
        pass
    return got


def _answers(s: socket.socket, interim: int | None = 1) -> list[tuple[int, dict, bytes]]:
    """Every answer `s` receives until the gateway closes it (status, lower-cased headers, body:
    Content-Length or chunked), checking that nothing else came. The gateway's interim answer to
    a half-close, a `100 Continue` (its probe for a client gone), is left out, checking that
    `interim` of them came (None: any number, where the timing decides)."""
    data, out, interims = _rest(s), [], 0
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"an answer cut in its headers: {head!r}"
        lines = head.decode("latin-1").split("\r\n")
        if lines[0].split()[1].startswith("1"):
            assert lines == ["HTTP/1.1 100 Continue"], lines
            interims += 1
            continue
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size, sep, data = data.partition(b"\r\n")
                assert sep, "a chunked answer cut short"
                n = int(size, 16)
                body, data = body + data[:n], data[n:]
                assert data[:2] == b"\r\n", data[:40]
                data = data[2:]
                if n == 0:
                    break
        else:
            n = int(headers.get("content-length", 0))
            body, data = data[:n], data[n:]
            assert len(body) == n, "an answer cut short"
        out.append((int(lines[0].split()[1]), headers, body))
    assert interim is None or interims == interim, (interims, out)
    return out


def _request(**extra) -> bytes:
    data = json.dumps(_body(COMPLETIONS, **extra)).encode()
    return _head(COMPLETIONS, length=len(data)) + data


def _completion(answer: tuple[int, dict, bytes]) -> None:
    status, _, raw = answer
    assert status == 200, (status, raw)
    assert json.loads(raw)["choices"][0]["text"] is not None, raw


def test_a_request_then_a_half_close_is_answered(gw):
    """A whole request, then the client's FIN: answered 200 (nothing came back before), and the
    connection is closed after it (the client can send no other request), saying so."""
    with _half_closed(gw, _request()) as s:
        (answer,) = _answers(s)
        _completion(answer)
        assert answer[1].get("connection", "").lower() == "close", answer[1]


def test_a_get_and_a_stream_after_a_half_close_are_answered(gw):
    """A GET without a body, and a streamed completion to its [DONE], on half-closed connections."""
    with _half_closed(gw, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as s:
        ((status, _, raw),) = _answers(s, None)  # the health answer may beat the FIN (no 100 then)
    assert status == 200 and json.loads(raw)["status"], (status, raw)
    with _half_closed(gw, _request(stream=True, max_tokens=4)) as s:
        ((status, headers, raw),) = _answers(s)
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), (status, headers)
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]


def test_a_body_cut_by_a_half_close_is_a_400_at_once(gw):
    """A body shorter than its Content-Length, then the FIN: the rest can never come, so the answer
    is a 400 invalid_body at once (not a --body-timeout 408 later, nor nothing)."""
    data = json.dumps(_body(COMPLETIONS)).encode()
    started = time.monotonic()
    with _half_closed(gw, _head(COMPLETIONS, length=len(data) + 10) + data) as s:
        ((status, headers, raw),) = _answers(s)
        waited = time.monotonic() - started
    err = _error(raw)
    assert (status, err["code"]) == (400, "invalid_body"), (status, err)
    assert "closed its side of the connection before the request body ended" in err["message"], err
    assert headers.get("connection", "").lower() == "close", headers
    assert waited < BODY_TIMEOUT / 2, waited


def test_a_half_close_that_asked_nothing_is_closed_at_once(gw):
    """A FIN with no request, or with part of one's headers, closes the connection at once, without
    a word (no 408 after --header-timeout: nobody is left to send the rest); one after a served
    request on a kept-alive connection does too. The gateway's log has no traceback."""
    for sent in (b"", b"GET /health HTTP/1.1\r\nHost: 1"):
        started = time.monotonic()
        with _half_closed(gw, sent) as s:
            assert _rest(s) == b""
            assert time.monotonic() - started < HEADER_TIMEOUT - 0.5
    with socket.create_connection(("127.0.0.1", gw.port), timeout=WAIT) as s:
        s.sendall(_request())
        _completion(_reply(s))
        started = time.monotonic()
        s.shutdown(socket.SHUT_WR)
        assert _rest(s) == b""
        assert time.monotonic() - started < HEADER_TIMEOUT - 0.5
    log = Path(gw.err.name).read_text(errors="replace")
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]


def _counted(g) -> dict:
    with socket.create_connection(("127.0.0.1", g.port), timeout=WAIT) as s:
        s.sendall(b"GET /metrics?format=json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        ((status, _, raw),) = _answers(s, 0)
    assert status == 200, raw
    return {(r["route"], r["status"]): r["count"] for r in json.loads(raw)["gateway"]["requests"]}


def test_a_client_that_leaves_still_cancels_its_generation(gw, no_eos):  # noqa: F811
    """A client that closes its connection altogether (its FIN is a half-close's too) while its
    generation runs is still noticed, and the handler (and the job) cancelled, a 499 in /metrics,
    long before the 2,000 tokens it asked for: a stream at its next events, a request answered in
    one piece by the reset its socket answers the gateway's interim 100 with (it ran to its end
    with the half-close answered and no probe: test_gateway's disconnect test failed). An HTTP/1.0
    request (nginx's default to its upstream) and requests pipelined behind another get no probe,
    so they close at the FIN as they always did (the first HalfClose kept them, and their
    generations ran to the end with nobody to read them)."""
    long = _request(max_tokens=2000, logit_bias=no_eos)
    cases = {"stream": _request(stream=True, max_tokens=2000, logit_bias=no_eos), "whole": long,
             "HTTP/1.0": long.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1),
             "pipelined": long + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"}
    for name, sent in cases.items():
        before = _counted(gw).get((COMPLETIONS, 499), 0)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=WAIT) as s:
            s.sendall(sent)
            if name == "stream":
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            else:
                time.sleep(0.3)  # its handler runs
            started = time.monotonic()
        while _counted(gw).get((COMPLETIONS, 499), 0) == before:
            assert time.monotonic() - started < WAIT / 3, f"the generation ran on after its client left ({name})"
            time.sleep(0.2)


def test_a_hook_this_aiohttp_cannot_take_stands_down_with_a_warning(caplog):
    """The gateway's hooks into aiohttp's connection handler share one installer
    (gateway_errors.mix_into_handlers). A hook whose aiohttp internals are missing, or whose class
    cannot take the handlers' place (another layout), leaves the server as it was with a warning
    that says what goes without; the hooks that fit still go on, on top of it. A real aiohttp
    server on a real socket: a line its parser refuses is answered in JSON (JsonErrorConnection),
    and a request then a half-close is answered (HalfClose)."""
    import asyncio
    import logging

    from aiohttp import web

    from dflash.daemon.gateway import half_close_answers, header_deadlines
    from dflash.daemon.gateway_errors import json_connection_errors, mix_into_handlers

    class Reads(web.RequestHandler):
        __slots__ = ()

    class Slotted(web.RequestHandler):
        __slots__ = ("extra",)  # a slot of its own: not aiohttp's layout

    async def ask(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        writer.write_eof()
        try:
            return await asyncio.wait_for(reader.read(), WAIT)
        finally:
            writer.close()

    async def serve(_request: web.Request) -> web.Response:
        return web.Response(text="served")

    async def main() -> tuple[tuple[bool, ...], bytes, bytes]:
        app = web.Application()
        app.router.add_get("/", serve)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            installed = (mix_into_handlers(runner.server, Reads, {}, "A goes without", needs=("_no_such_slot",)),
                         mix_into_handlers(runner.server, Slotted, {}, "B goes without"),
                         json_connection_errors(runner.server), header_deadlines(runner.server, WAIT),
                         half_close_answers(runner.server))
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            return installed, await ask(port, b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n"), \
                await ask(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="dflash.gateway"):
        installed, refused, served = asyncio.run(main())
    assert installed == (False, False, True, True, True), installed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert "Reads" in warned[0] and "_no_such_slot" in warned[0] and warned[0].endswith("A goes without"), warned
    assert "Slotted" in warned[1] and warned[1].endswith("B goes without"), warned
    assert refused.startswith(b"HTTP/1.0 400") and b'"code": "invalid_http"' in refused, refused
    # HalfClose's probe first (the request is HTTP/1.1), then the answer
    assert served.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200") and served.endswith(b"served"), served


def test_no_interim_100_follows_an_answer_being_written(caplog):
    """A FIN that comes while a large answer is still being written (its handler has returned and
    aiohttp drains the body) draws no probe: the first HalfClose wrote its `100 Continue` after the
    whole answer (25 bytes of junk after the body). A real aiohttp server on a real socket."""
    import asyncio

    from aiohttp import web

    from dflash.daemon.gateway import half_close_answers

    big = b"x" * (32 << 20)

    async def serve(_request: web.Request) -> web.Response:
        return web.Response(body=big)

    async def main() -> bytes:
        app = web.Application()
        app.router.add_get("/", serve)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            assert half_close_answers(runner.server)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = await asyncio.wait_for(reader.read(65536), WAIT)  # the answer has begun; the rest waits
            await asyncio.sleep(0.5)
            writer.write_eof()
            while chunk := await asyncio.wait_for(reader.read(1 << 20), WAIT):
                got += chunk
                if len(got) > len(big) and got.endswith(big):
                    await asyncio.sleep(0.5)  # anything written after the answer comes now
                    got += await asyncio.wait_for(reader.read(1 << 20), WAIT) if not reader.at_eof() else b""
                    break
            writer.close()
            return got
        finally:
            await runner.cleanup()

    got = asyncio.run(main())
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(body) == len(big) and body == big, (len(body), body[len(big):][:60])
