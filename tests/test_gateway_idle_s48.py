"""Connections that hold the gateway without a request: one that sends nothing, or never completes
its headers (slowloris), was held for aiohttp's keep-alive timeout (3630 s), since aiohttp calls no
handler before the headers are complete; an idle kept-alive connection was held as long. Now a
request's headers must arrive within --header-timeout (from the connection, or from the first byte
of a kept-alive connection's next request) and an idle kept-alive connection is closed after
--keepalive-timeout. Each test drives a real `dflash serve --attach` process on a real daemon
(tiny model) over real sockets, and fails on the code before the change. No mocks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_fixtures import tiny_pair  # noqa: F401
from test_adversarial_s47 import daemon, no_eos  # noqa: F401 (module fixtures: a daemon, a bias against end of text)
from test_gateway import ROOT, Gateway
from test_gateway_s48 import _body, _error, _head, _reply, _trickle

COMPLETIONS = "/v1/completions"
HEADER_TIMEOUT, KEEPALIVE_TIMEOUT, BODY_TIMEOUT = 1.0, 3.0, 6.0
SLACK = 4.0  # for a loaded 2-core machine
STREAM_MARGIN = 0.5  # seconds a stream must outlast the header timeout by


@pytest.fixture(scope="module")
def idle(daemon):  # noqa: F811
    with Gateway(daemon, "--header-timeout", str(HEADER_TIMEOUT), "--keepalive-timeout", str(KEEPALIVE_TIMEOUT),
                 "--body-timeout", str(BODY_TIMEOUT)) as g:
        yield g


def _connect(g) -> socket.socket:
    return socket.create_connection(("127.0.0.1", g.port), timeout=HEADER_TIMEOUT + KEEPALIVE_TIMEOUT + 15)


def _closed_silently(s: socket.socket, started: float, after: float) -> None:
    """The gateway closes `s` without a byte, `after` seconds from `started` (give or take)."""
    try:
        got = s.recv(65536)
    except ConnectionResetError:
        got = b""
    waited = time.monotonic() - started
    assert got == b"", got
    assert after - 0.2 <= waited < after + SLACK, waited


def _late_headers(s: socket.socket, started: float) -> None:
    """The answer on `s` is a 408 for late headers, about HEADER_TIMEOUT after `started`, and the
    connection is closed right after it."""
    status, headers, raw = _reply(s)
    waited = time.monotonic() - started
    err = _error(raw)
    assert (status, err["code"], err["param"]) == (408, "request_timeout", None), (status, err)
    assert "--header-timeout" in err["message"] and f"{HEADER_TIMEOUT:g} s" in err["message"], err
    assert headers.get("connection", "").lower() == "close", headers
    assert headers.get("content-type", "").startswith("application/json"), headers
    assert HEADER_TIMEOUT - 0.2 <= waited < HEADER_TIMEOUT + SLACK, waited
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass


def _request(port: int, keep: bool = True) -> bytes:
    data = json.dumps(_body(COMPLETIONS)).encode()
    return _head(COMPLETIONS, *(() if keep else ("Connection: close",)), length=len(data)) + data


def _ok(s: socket.socket) -> None:
    status, headers, raw = _reply(s)
    assert status == 200, (status, raw)
    assert json.loads(raw)["choices"][0]["text"] is not None


def test_a_connection_that_sends_nothing_is_closed(idle):
    """A connection that sends nothing was held for aiohttp's keep-alive timeout (an hour): it is
    closed after --header-timeout, without an answer (it asked nothing)."""
    with _connect(idle) as s:
        _closed_silently(s, time.monotonic(), HEADER_TIMEOUT)


def test_headers_that_stop_coming_are_a_408(idle):
    """A client that sends part of its headers, then nothing, is answered 408 request_timeout after
    --header-timeout (from the connection), and the connection is closed."""
    with _connect(idle) as s:
        started = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        _late_headers(s, started)


def test_trickled_headers_are_a_408_too(idle):
    """The deadline bounds the whole of the headers, not the wait between bytes (slowloris: a header
    byte every 0.2 s kept the connection for ever)."""
    with _connect(idle) as s:
        started = time.monotonic()
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
        _trickle(s, (bytes([byte]) for byte in head), HEADER_TIMEOUT + SLACK)
        s.settimeout(HEADER_TIMEOUT + SLACK + 10)
        _late_headers(s, started)


def test_a_kept_alive_connection_idles_for_the_keepalive_timeout_then_closes(idle):
    """Between requests the idle time is --keepalive-timeout's, not --header-timeout's: a
    connection idle longer than the header timeout still serves its next request, and one idle for
    the keep-alive timeout is closed without a word (aiohttp's 3630 s before)."""
    with _connect(idle) as s:
        s.sendall(_request(idle.port))
        _ok(s)
        time.sleep(HEADER_TIMEOUT + 0.8)
        s.sendall(_request(idle.port))
        _ok(s)
        _closed_silently(s, time.monotonic(), KEEPALIVE_TIMEOUT)


def test_a_kept_alive_connections_next_headers_have_the_header_timeout(idle):
    """On a kept-alive connection the header deadline runs from the first byte of the next request:
    headers begun after an idle spell and not finished are a 408 HEADER_TIMEOUT after that byte."""
    with _connect(idle) as s:
        s.sendall(_request(idle.port))
        _ok(s)
        time.sleep(HEADER_TIMEOUT + 0.5)
        started = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 1")
        _late_headers(s, started)



def test_an_empty_line_between_requests_does_not_start_the_deadline(idle):
    """Empty lines before a request are ignored (RFC 9112 2.2; some clients send a CRLF after a
    body): one on a kept-alive connection drew a 408 nobody asked for after --header-timeout and
    closed the connection; the next request on it is served."""
    with _connect(idle) as s:
        s.sendall(_request(idle.port))
        _ok(s)
        s.sendall(b"\r\n")
        time.sleep(HEADER_TIMEOUT + 0.8)  # past the header deadline, within the keep-alive one
        s.sendall(_request(idle.port))
        _ok(s)

def test_headers_that_arrive_in_pieces_in_time_are_served(idle, no_eos):  # noqa: F811
    """Headers sent in pieces that end within the deadline, a body with Expect: 100-continue sent
    after a pause longer than the header timeout (the body has --body-timeout), pipelined
    requests, and a stream that lasts longer than the header timeout are all served; the
    gateway's log has no traceback."""
    with _connect(idle) as s:
        req = _request(idle.port)
        for i in range(0, 40, 10):
            s.sendall(req[i:i + 10])
            time.sleep(0.15)
        s.sendall(req[40:])
        _ok(s)
    with _connect(idle) as s:
        data = json.dumps(_body(COMPLETIONS)).encode()
        s.sendall(_head(COMPLETIONS, "Expect: 100-continue", length=len(data)))
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        time.sleep(HEADER_TIMEOUT + 0.8)
        s.sendall(data)
        _ok(s)
    with _connect(idle) as s:
        s.sendall(_request(idle.port) * 2 + _request(idle.port, keep=False))
        for _ in range(3):
            _ok(s)
        assert s.recv(65536) == b""
    # A stream that lasts longer than the header timeout is not cut. Timed from its first byte,
    # which comes after the connection was accepted, when a deadline still armed would have run
    # from: one that lasts HEADER_TIMEOUT + STREAM_MARGIN from there outlived it for sure. The
    # tiny model's speed varies with the machine's load, so max_tokens doubles until one does.
    lasted, max_tokens = 0.0, 256
    while lasted <= HEADER_TIMEOUT + STREAM_MARGIN:
        assert max_tokens <= 2048, f"no stream lasted {HEADER_TIMEOUT + STREAM_MARGIN} s (the last {lasted:.2f} s)"
        with _connect(idle) as s:
            data = json.dumps(_body(COMPLETIONS, stream=True, max_tokens=max_tokens, logit_bias=no_eos)).encode()
            s.sendall(_head(COMPLETIONS, length=len(data)) + data)
            got, first = s.recv(65536), time.monotonic()
            while not got.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                more = s.recv(65536)
                assert more, got[-300:]
                got += more
            lasted = time.monotonic() - first
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        # it ran to its max_tokens (no end of text), not cut, and ended as a stream does
        assert b'"finish_reason":"length"' in got and b"data: [DONE]" in got, got[-300:]
        max_tokens *= 2
    log = Path(idle.err.name).read_text(errors="replace")
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]


def test_late_headers_are_counted_and_the_defaults_are_documented(idle):
    """The 408s for late headers are in /metrics under the route "other"; `dflash serve --help`
    gives the defaults: 30 s for the headers, 75 s for an idle kept-alive connection."""
    with _connect(idle) as s:
        started = time.monotonic()
        s.sendall(b"GET /he")
        _late_headers(s, started)
    with _connect(idle) as s:
        s.sendall(b"GET /metrics?format=json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, raw = _reply(s)
    counted = {(r["route"], r["status"]): r["count"] for r in json.loads(raw)["gateway"]["requests"]}
    assert counted.get(("other", 408), 0) >= 1, counted
    out = subprocess.run([sys.executable, "-m", "dflash.engine.cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    flat = " ".join(out.split())
    assert "--header-timeout" in flat and "--keepalive-timeout" in flat, out
    assert "[default: 30.0;" in flat.split("--header-timeout", 1)[1].split("--", 1)[0], out
    assert "[default: 75.0;" in flat.split("--keepalive-timeout", 1)[1].split("--", 1)[0], out
