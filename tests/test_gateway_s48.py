"""Gateway fixes from session 47's adversarial hunt, left open then: fields accepted without
effect took values of any JSON type, a Content-Encoding list was read as it came, and a client
that stalled its body held its connection for ever. Each test drives a real `dflash serve
--attach` process on a real daemon (tiny model) over real sockets, and fails on the code before
its fix. No mocks."""

from __future__ import annotations

import gzip
import itertools
import json
import socket
import time
import weakref
from pathlib import Path
from typing import Iterable

import pytest
from daemon_fixtures import tiny_pair  # noqa: F401
from test_adversarial_s47 import daemon, gw  # noqa: F401 (module fixtures: a daemon, a gateway)
from test_gateway import Gateway

MSGS = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BODY_TIMEOUT = 1.0  # the short --body-timeout of the `slow` gateway, seconds


@pytest.fixture(scope="module")
def slow(daemon):
    """A gateway that waits BODY_TIMEOUT for a request's body."""
    with Gateway(daemon, "--body-timeout", str(BODY_TIMEOUT)) as g:
        yield g


def _body(path: str, **extra) -> dict:
    base = {"messages": MSGS} if path == CHAT else {"prompt": "Once"}
    return {**base, "max_tokens": 2, **extra}


def _error(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error", err
    return err


def _head(path: str, *headers: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", *headers]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


_UNREAD: "weakref.WeakKeyDictionary[socket.socket, bytes]" = weakref.WeakKeyDictionary()


def _reply(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP answer read off a raw socket: status, lower-cased headers, body (Content-Length).
    Bytes past it (the next pipelined answer, come in the same recv) are kept for the next call:
    they were returned as part of this body, which then failed its test now and then."""
    data = _UNREAD.pop(s, b"")
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        assert got, f"connection closed before an answer: {data!r}"
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        got = s.recv(65536)
        assert got, "connection closed mid-answer"
        body += got
    if body[length:]:
        _UNREAD[s] = body[length:]
    return int(lines[0].split()[1]), headers, body[:length]


def _send(port: int, data: bytes, timeout: float = 30) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return _reply(s)


def _post(port: int, path: str, body: dict | bytes, *headers: str) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _send(port, _head(path, *headers, "Connection: close", length=len(data)) + data)


def _trickle(s: socket.socket, pieces: Iterable[bytes], within: float) -> None:
    """Send `pieces` 0.2 s apart until the server answers (a byte to read), stops taking them, or
    `within` seconds pass; the socket is left non-blocking (a settimeout makes it blocking again)."""
    started = time.monotonic()
    s.setblocking(False)
    for piece in pieces:
        if time.monotonic() - started > within:
            return
        try:
            s.send(piece)
        except OSError:
            return
        time.sleep(0.2)
        try:
            if s.recv(1, socket.MSG_PEEK):
                return
        except BlockingIOError:
            pass


# ----------------------------------------------------------------------------- 1: types of ignored fields

WRONG_TYPES = [
    (CHAT, "echo", 0), (CHAT, "echo", "false"), (COMPLETIONS, "echo", 0),
    (CHAT, "tools", 0), (CHAT, "tools", {}), (CHAT, "tools", ""), (CHAT, "functions", False),
    (CHAT, "logprobs", "false"), (CHAT, "logprobs", []), (COMPLETIONS, "logprobs", "0"),
    (CHAT, "top_logprobs", False), (COMPLETIONS, "top_logprobs", 0.5),
    (CHAT, "response_format", "text"), (CHAT, "tool_choice", 0), (CHAT, "tool_choice", ["none"]),
    (CHAT, "function_call", 0), (COMPLETIONS, "suffix", 5), (COMPLETIONS, "suffix", False),
]


@pytest.mark.parametrize("path, name, value", WRONG_TYPES,
                         ids=[f"{'chat' if p == CHAT else 'completion'}-{n}-{v!r}" for p, n, v in WRONG_TYPES])
def test_a_field_accepted_without_effect_refuses_a_wrong_type(gw, path, name, value):
    """echo, tools, functions, logprobs, top_logprobs (and the fields refused at any other value:
    response_format, tool_choice, function_call, suffix) have OpenAI's JSON types: another type is
    a 400 invalid_type naming the field, as OpenAI answers. `"echo": 0` and `"tools": 0` were taken
    as their neutral values (200), `"response_format": "text"` was an unsupported_parameter."""
    status, _, raw = _post(gw.port, path, _body(path, **{name: value}))
    err = _error(raw)
    assert (status, err["code"], err["param"]) == (400, "invalid_type", name), (status, err)
    assert err["message"].startswith(f"'{name}' must be "), err


def test_logprobs_takes_either_neutral_value_on_both_endpoints_and_null_is_absent(gw):
    """logprobs is a boolean in a chat and an integer in a completion (OpenAI's two APIs); clients
    that send `false` (or 0) to both were served before, and still are; a string is refused. null
    stays accepted for every field accepted without effect, as are their neutral values."""
    for path in (CHAT, COMPLETIONS):
        for value in (False, 0):
            assert _post(gw.port, path, _body(path, logprobs=value))[0] == 200, (path, value)
    status, _, raw = _post(gw.port, COMPLETIONS, _body(COMPLETIONS, logprobs="false"))
    assert (status, _error(raw)["code"]) == (400, "invalid_type")
    nulls = dict.fromkeys(("user", "metadata", "store", "service_tier", "parallel_tool_calls", "tool_choice",
                           "top_logprobs", "logprobs", "n", "tools", "response_format", "echo", "best_of", "suffix",
                           "functions", "function_call"))
    neutral = {"user": "u", "metadata": {}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
               "tool_choice": "none", "top_logprobs": 0, "n": 1.0, "tools": [], "response_format": {"type": "text"},
               "echo": False, "best_of": 1, "functions": [], "function_call": "none"}
    for path in (CHAT, COMPLETIONS):
        for extra in (nulls, neutral):
            status, _, raw = _post(gw.port, path, _body(path, **extra))
            assert status == 200, (path, extra, raw[:300])


# ----------------------------------------------------------------------------- 2: Content-Encoding lists


def _gz(body: dict) -> bytes:
    return gzip.compress(json.dumps(body).encode())


def _refused_coding(reply: tuple[int, dict, bytes], shown: str) -> None:
    status, headers, raw = reply
    err = _error(raw)
    assert (status, err["code"], err["param"]) == (415, "unsupported_content_encoding", None), (status, err)
    assert shown in err["message"] and "gzip, deflate" in err["message"] and "identity" in err["message"], err
    accepted = [c.strip() for c in headers["accept-encoding"].split(",")]
    assert {"gzip", "deflate", "identity"} <= set(accepted), headers
    assert headers.get("connection", "").lower() == "close", headers


def test_a_content_encoding_list_is_a_415_naming_the_supported_codings(gw):
    """`Content-Encoding: gzip, identity` (a list of codings, which HTTP applies in order) was read
    as it came: aiohttp decodes a single coding only, so a gzip body was answered 400 invalid_json.
    A list is now refused, 415 unsupported_content_encoding, naming the codings taken (and
    `Accept-Encoding` listing them, RFC 7694)."""
    body = _body(COMPLETIONS)
    _refused_coding(_post(gw.port, COMPLETIONS, _gz(body), "Content-Encoding: gzip, identity"), "gzip, identity")
    _refused_coding(_post(gw.port, COMPLETIONS, gzip.compress(_gz(body)), "Content-Encoding: gzip, gzip"),
                    "gzip, gzip")


def test_content_encoding_sent_twice_is_a_list_too(gw):
    """Two Content-Encoding header lines are one list (RFC 9110 5.3): aiohttp decoded the body with
    one of them only (a twice-gzipped body was a 400 invalid_json)."""
    data = gzip.compress(_gz(_body(COMPLETIONS)))
    reply = _post(gw.port, COMPLETIONS, data, "Content-Encoding: gzip", "Content-Encoding: gzip")
    _refused_coding(reply, "gzip, gzip")


def test_an_unknown_content_coding_is_a_415_not_read_as_plain_json(gw):
    """A coding aiohttp does not know (`compress`, `x-custom`) left the body as it came, so a plain
    JSON body labelled compressed was served (200). One coding of gzip, deflate or identity (any
    case) is still served."""
    data = json.dumps(_body(COMPLETIONS)).encode()
    for coding in ("compress", "x-custom"):
        _refused_coding(_post(gw.port, COMPLETIONS, data, f"Content-Encoding: {coding}"), coding)
    assert _post(gw.port, COMPLETIONS, data, "Content-Encoding: identity")[0] == 200
    assert _post(gw.port, COMPLETIONS, _gz(_body(COMPLETIONS)), "Content-Encoding: GZIP")[0] == 200


# ----------------------------------------------------------------------------- 3: a body that stalls


def _timed_out(s: socket.socket, started: float) -> None:
    """The answer on `s` is the 408, soon after BODY_TIMEOUT, and the gateway closes the connection
    right after it (not after aiohttp's 10 s of lingering)."""
    status, headers, raw = _reply(s)
    waited = time.monotonic() - started
    err = _error(raw)
    assert (status, err["code"], err["param"]) == (408, "request_timeout", None), (status, err)
    assert "--body-timeout" in err["message"] and f"{BODY_TIMEOUT:g} s" in err["message"], err
    assert headers.get("connection", "").lower() == "close", headers
    assert BODY_TIMEOUT - 0.1 <= waited < BODY_TIMEOUT + 5, waited  # (slack for a loaded 2-core machine)
    s.settimeout(8)
    end = time.monotonic()
    try:
        while s.recv(65536):  # (the bytes a trickling client sent meanwhile are not answered)
            pass
    except ConnectionResetError:
        pass
    assert time.monotonic() - end < 6, "the connection was held after the 408 (aiohttp lingers 10 s)"


def test_a_body_that_stops_coming_is_a_408_and_frees_the_connection(slow):
    """A client that sends its headers and part of its body, then nothing, held the connection (and
    a handler) for ever: no answer, no close. It is now answered 408 request_timeout after
    --body-timeout, and the connection is closed."""
    with socket.create_connection(("127.0.0.1", slow.port), timeout=15) as s:
        s.sendall(_head(COMPLETIONS, length=100) + b'{"prompt": ')
        _timed_out(s, time.monotonic())


def test_a_trickled_body_is_a_408_too(slow):
    """The timeout bounds the whole body, not the wait between bytes: one byte every 0.2 s
    kept a 100-byte body coming for 20 s, and a slower trickle for ever."""
    with socket.create_connection(("127.0.0.1", slow.port), timeout=15) as s:
        s.sendall(_head(COMPLETIONS, length=100))
        started = time.monotonic()
        _trickle(s, itertools.repeat(b" "), BODY_TIMEOUT + 3)
        s.settimeout(15)
        _timed_out(s, started)


def test_a_chunked_body_that_stalls_is_a_408(slow):
    """The same for a chunked body whose last chunk never comes; a body sent at once is served by
    the same gateway, and it still serves after the 408s. A client that leaves while its body is
    read is no error in the gateway's log (the first form of this fix, asyncio.wait_for, made it a
    ConnectionResetError that aiohttp logged with tracebacks)."""
    with socket.create_connection(("127.0.0.1", slow.port), timeout=15) as s:
        s.sendall(_head(COMPLETIONS, "Transfer-Encoding: chunked") + b"5\r\n{\"pro\r\n")
        _timed_out(s, time.monotonic())
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", slow.port), timeout=15) as s:
            s.sendall(_head(COMPLETIONS, length=100) + b'{"prompt": ')
            time.sleep(0.3)  # the handler is reading the body when the client leaves
    status, _, raw = _post(slow.port, COMPLETIONS, _body(COMPLETIONS))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] is not None
    get = b"GET /metrics?format=json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    metrics = json.loads(_send(slow.port, get)[2])
    counted = {(r["route"], r["status"]): r["count"] for r in metrics["gateway"]["requests"]}
    assert counted.get((COMPLETIONS, 408), 0) >= 1, counted
    log = Path(slow.err.name).read_text(errors="replace")
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]
