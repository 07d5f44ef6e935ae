"""Every HTTP error the gateway answers is OpenAI's error object, aiohttp's own included (its
HTTPExceptions, and the answers its HTTP parser makes to requests it cannot parse, before any
application code runs), and an error raised after a stream began ends that stream as an error
event instead of breaking it.

An in-process gateway (its aiohttp app, on 127.0.0.1, served as `dflash serve` serves it) with a
stand-in for the daemon client, so failures a real daemon never produces (a bug mid-stream, an
HTTPException raised by a handler) can be made on purpose; then a real `dflash serve` on a real
daemon for aiohttp's own errors, over raw sockets and with a real aiohttp client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from dflash.client.client import Delta, Result
from dflash.daemon.config import DaemonConfig
from dflash.daemon.gateway import Gateway, start_runner


def _error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


class _FakeClient:
    """The daemon client's stream(): one delta, then what the prompt asks for."""

    def stream(self, prompt, **kw):
        async def events():
            yield Delta("Hello", [1], [False])
            if prompt == "bug":
                raise RuntimeError("a gateway bug mid-stream")
            if prompt == "http":
                raise web.HTTPServiceUnavailable(text="backend gone")
            yield Result("job", "Hello", [1], {}, "stop")
        return events()

    def close(self) -> None:
        pass


class _Server:
    """The gateway's app served in a thread's event loop."""

    def __init__(self, max_body_bytes: int = 2048, gw: Gateway | None = None):
        """`gw`: a gateway of one's own (on a real daemon); by default one with a stand-in client."""
        if gw is None:
            gw = Gateway("ipc:///nonexistent/dflash-test", DaemonConfig(), max_body_bytes=max_body_bytes)

            async def rows():
                return [{"model": "/models/tiny"}]

            gw._model_rows = rows
            gw.client = _FakeClient()
        self.gw = gw
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = self.loop.run_until_complete(start_runner(self.gw, handler_cancellation=True, access_log=None))
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.port = self.runner.addresses[0][1]
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    def raw(self, data: bytes) -> bytes:
        """Send bytes, read until the server closes (every request here says Connection: close)."""
        return _raw(self.port, data)


def _raw(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send bytes on a fresh connection, read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _request(method: str, path: str, body: bytes | None = b"", headers: dict | None = None) -> bytes:
    h = {"Host": "127.0.0.1", "Connection": "close", **(headers or {})}
    if body is not None and "Transfer-Encoding" not in h:
        h.setdefault("Content-Length", str(len(body)))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
    return head.encode() + b"\r\n" + (body or b"")


def _parse(reply: bytes) -> tuple[int, dict, bytes]:
    """Status, lower-cased headers and body (de-chunked) of one HTTP/1.x answer."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            size, _, body = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, body = out + body[:n], body[n + 2:]
        body = out
    return status, headers, body


@pytest.fixture(scope="module")
def server():
    s = _Server()
    try:
        yield s
    finally:
        s.stop()


def _sse(body: bytes) -> list[str]:
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


@pytest.mark.parametrize("prompt,status,kind", [("bug", 500, "server_error"), ("http", 503, "server_error")])
def test_an_error_after_the_stream_began_is_an_event_not_a_second_response(server, prompt, status, kind):
    """It was a second HTTP response written into the chunked body: no client could read it."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True}).encode()
    reply = server.raw(_request("POST", "/v1/completions", body))
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    code, headers, raw = _parse(reply)
    assert code == 200 and headers["content-type"].startswith("text/event-stream")
    events = _sse(raw)
    assert json.loads(events[0])["choices"][0]["text"] == "Hello"
    err = json.loads(events[1])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == kind
    assert events[2:] == ["[DONE]"]
    # the same failure before any stream is an ordinary error answer with its own status
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    code, headers, raw = _parse(server.raw(_request("POST", "/v1/completions", body)))
    assert code == status and headers["content-type"].startswith("application/json")
    assert _error(raw)["type"] == kind


def test_an_httpexception_keeps_its_text_and_a_5xx_is_a_server_error(server):
    body = json.dumps({"prompt": "http", "max_tokens": 4}).encode()
    code, _, raw = _parse(server.raw(_request("POST", "/v1/completions", body)))
    err = _error(raw)
    assert code == 503 and err["type"] == "server_error" and "backend gone" in err["message"]


def test_expect_header_errors_are_json(server):
    """aiohttp answers Expect before any middleware: an unknown expectation was a text/plain 417."""
    code, headers, raw = _parse(server.raw(_request("POST", "/v1/completions", b"{}", {"Expect": "teapot"})))
    assert code == 417 and headers["content-type"].startswith("application/json")
    assert _error(raw)["code"] == "expectation_failed"
    # 100-continue with a declared body over the cap: 413 at once, the body is never sent
    data = _request("POST", "/v1/completions", None, {"Expect": "100-continue", "Content-Length": "5000"})
    code, headers, raw = _parse(server.raw(data))
    assert code == 413 and _error(raw)["code"] == "body_too_large"


def test_expect_100_continue_still_works(server):
    body = json.dumps({"prompt": "fine", "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(_request("POST", "/v1/completions", None, {"Expect": "100-continue",
                                                             "Content-Length": str(len(body))}))
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += s.recv(1)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        s.sendall(body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    code, _, raw = _parse(reply)
    assert code == 200 and json.loads(raw)["choices"][0]["text"] == "Hello"


@pytest.mark.parametrize("method,path,body,headers,status,code", [
    ("GET", "/v2/nothing", None, {}, 404, None),
    ("DELETE", "/v1/completions", None, {}, 405, None),
    ("POST", "/v1/completions", b"x" * 5000, {}, 413, "body_too_large"),
    ("POST", "/v1/completions", b"{", {}, 400, "invalid_json"),
    ("POST", "/v1/completions", '{"prompt": "é"}'.encode("latin-1"),
     {"Content-Type": "application/json; charset=latin-1"}, 400, "invalid_json"),
    ("POST", "/v1/completions", b"not gzip", {"Content-Encoding": "gzip"}, 400, "invalid_body"),
])
def test_aiohttp_errors_in_openai_shape(server, method, path, body, headers, status, code):
    code_, h, raw = _parse(server.raw(_request(method, path, body, headers)))
    err = _error(raw)
    assert (code_, err["code"], err["param"]) == (status, code, None)
    assert h["content-type"].startswith("application/json")
    if status == 405:
        assert h["allow"] == "POST"


def _head(request_line: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    return request_line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


HOST, CLOSE, CHUNKED = b"Host: 127.0.0.1", b"Connection: close", b"Transfer-Encoding: chunked"
POST = b"POST /v1/completions HTTP/1.1"
# Requests aiohttp's HTTP parser refuses before any route or middleware runs (its answer was
# text/plain), with a word the JSON message must keep: what was wrong.
UNPARSABLE = {
    "garbage": (b"GARBAGE\r\n\r\n", "Invalid method"),
    "bad method": (_head(b"G@T /v1/models HTTP/1.1", HOST, CLOSE), "Invalid method"),
    "bad version": (_head(b"GET /v1/models HTTP/9.9", HOST, CLOSE), "HTTP version"),
    "bare LF": (b"GET /v1/models HTTP/1.1\nHost: x\n\n", "CRLF"),
    "Content-Length abc": (_head(POST, HOST, b"Content-Length: abc", CLOSE, body=b"{}"), "Content-Length"),
    "Content-Length -1": (_head(POST, HOST, b"Content-Length: -1", CLOSE, body=b"{}"), "Content-Length"),
    "Content-Length twice": (_head(POST, HOST, b"Content-Length: 2", b"Content-Length: 3", CLOSE, body=b"{}"),
                             "Content-Length"),
    "Content-Length overflow": (_head(POST, HOST, b"Content-Length: " + b"9" * 30, CLOSE), "Content-Length"),
    "Content-Length and chunked": (_head(POST, HOST, b"Content-Length: 2", CHUNKED, CLOSE, body=b"0\r\n\r\n"),
                                   "Transfer-Encoding"),
    "unknown Transfer-Encoding": (_head(POST, HOST, b"Transfer-Encoding: gzip", CLOSE, body=b"{}"), "Transfer-Encoding"),
    "bad chunk size": (_head(POST, HOST, CHUNKED, CLOSE, body=b"zz\r\n{}\r\n0\r\n\r\n"), "chunk size"),
    "header over 8190 bytes": (_head(b"GET /v1/models HTTP/1.1", HOST, b"X-Big: " + b"a" * 9000, CLOSE), "8190 bytes"),
    "URL over 8190 bytes": (_head(b"GET /" + b"a" * 9000 + b" HTTP/1.1", HOST, CLOSE), "8190 bytes"),
    "too many headers": (_head(b"GET /v1/models HTTP/1.1", HOST, *(b"X-H%d: 1" % i for i in range(200)), CLOSE),
                         "Too many headers"),
    "bad header name": (_head(b"GET /v1/models HTTP/1.1", HOST, b"Bad Header: x", CLOSE), "header token"),
    "NUL in a header": (_head(b"GET /v1/models HTTP/1.1", HOST, b"X-A: a\x00b", CLOSE), "header value"),
    "no Host": (_head(b"GET /v1/models HTTP/1.1", CLOSE), "Host"),
    "brotli body": (_head(POST, HOST, b"Content-Encoding: br", b"Content-Length: 2", CLOSE, body=b"{}"), "brotli"),
    "TLS on the HTTP port": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, "HTTPS"),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "PRI"),
}


@pytest.mark.parametrize("name", list(UNPARSABLE))
def test_requests_aiohttp_cannot_parse_are_answered_in_openai_shape(server, name):
    """They were aiohttp's text/plain 400, made before any middleware: now the same status, the
    connection closed as before, and OpenAI's error object saying what was wrong."""
    data, word = UNPARSABLE[name]
    before = server.gw.metrics.requests[("other", 400)]
    reply = server.raw(data)  # read until the server closes: it does, after the answer
    assert reply.count(b" 400 Bad Request\r\n") == 1, reply
    code, headers, raw = _parse(reply)
    assert code == 400 and headers["content-type"].startswith("application/json"), reply
    err = _error(raw)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_http", None)
    assert err["message"].startswith("invalid HTTP request: ") and word in err["message"], err
    assert "\n" not in err["message"] and len(err["message"]) < 400  # one line, the quoted bytes cut short
    assert server.gw.metrics.requests[("other", 400)] == before + 1  # counted for /metrics, as the others


def test_a_parse_error_after_a_good_request_on_the_same_connection(server):
    """Keep-alive: the first request is answered as usual, the garbage sent after it in JSON."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(_head(b"GET /v1/models HTTP/1.1", HOST))
        first = b""
        while b'"data"' not in first:
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK"), first
        s.sendall(b"GARBAGE\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    code, headers, raw = _parse(reply)
    assert code == 400 and headers["content-type"].startswith("application/json")
    assert _error(raw)["code"] == "invalid_http"


def test_expect_on_an_unknown_path_is_json(server):
    """aiohttp's default Expect handler (paths no route has) raised a text/plain 417 before the
    middlewares; the connection answers it in JSON."""
    code, headers, raw = _parse(server.raw(_request("POST", "/nope", b"{}", {"Expect": "teapot"})))
    assert code == 417 and headers["content-type"].startswith("application/json")
    err = _error(raw)
    assert err["code"] == "expectation_failed" and "teapot" in err["message"]


def test_a_chunked_body_over_the_cap_is_413_json(server):
    """No Content-Length to refuse up front: the cap is hit while reading (aiohttp's client_max_size)."""
    body = b"".join(b"%x\r\n%s\r\n" % (1000, b"x" * 1000) for _ in range(5)) + b"0\r\n\r\n"
    code, headers, raw = _parse(server.raw(_head(POST, HOST, CHUNKED, CLOSE, body=body)))
    assert code == 413 and headers["content-type"].startswith("application/json")
    assert _error(raw)["code"] == "body_too_large"


def test_broken_chunked_framing_after_the_body_began_gets_no_answer(server):
    """What stays out of reach (docs/gateway.md): when the broken framing arrives after the handler
    began reading the body, aiohttp (3.14) queues its parse error as the connection's next message
    and never fails the body being read, so nothing is answered until the client gives up. Pinned
    here so that the documentation is revisited when aiohttp changes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(_head(POST, HOST, CHUNKED, CLOSE, body=b"2\r\n{}"))
        time.sleep(0.5)  # the handler is reading the body now
        s.sendall(b"\r\nzz\r\n0\r\n\r\n")
        s.settimeout(1.5)
        with pytest.raises(socket.timeout):
            s.recv(65536)


# ----------------------------------------------------------------------------- a real daemon and gateway

from daemon_fixtures import Daemon, tiny_pair  # noqa: E402,F401
from test_gateway import KEY, Gateway as GatewayProcess  # noqa: E402


@pytest.fixture(scope="module")
def real_gw(tiny_pair):  # noqa: F811
    d = Daemon(*tiny_pair).start()
    try:
        with GatewayProcess(d, "--api-key", KEY, "--max-body-bytes", "4096") as g:
            yield g
    finally:
        d.stop()


def test_a_real_gateway_answers_parse_errors_in_json(real_gw):
    """`dflash serve` itself (its run_gateway): raw sockets with what aiohttp's parser refuses."""
    def parse_errors_counted() -> int:
        rows = json.loads(real_gw.http("GET", "/metrics?format=json")[2])["gateway"]["requests"]
        return sum(r["count"] for r in rows if (r["route"], r["status"]) == ("other", 400))

    before = parse_errors_counted()
    for name in ("garbage", "Content-Length abc", "Content-Length and chunked", "header over 8190 bytes",
                 "bad chunk size", "TLS on the HTTP port"):
        data, word = UNPARSABLE[name]
        code, headers, raw = _parse(_raw(real_gw.port, data))
        err = _error(raw)
        assert code == 400 and headers["content-type"].startswith("application/json"), (name, raw)
        assert err["code"] == "invalid_http" and word in err["message"], (name, err)
    code, headers, raw = _parse(_raw(real_gw.port, _request("POST", "/nope", b"{}", {"Expect": "teapot"})))
    assert code == 417 and _error(raw)["code"] == "expectation_failed"
    assert parse_errors_counted() == before + 6  # in /metrics, as every other answer


def test_a_real_aiohttp_client_gets_json_errors(real_gw):
    """A real aiohttp client against `dflash serve`: a chunked body over --max-body-bytes (no
    Content-Length), a Content-Length over it, invalid JSON, a gzip body that does not decompress.
    (A request the parser refuses is answered and the connection closed at once, as aiohttp
    always did, so a client still sending its body may see a reset first: raw sockets above.)"""
    import aiohttp

    async def go() -> list[tuple[int, str, dict]]:
        out = []
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

        async def chunks():
            for _ in range(8):
                yield b"x" * 1024

        async with aiohttp.ClientSession(f"http://127.0.0.1:{real_gw.port}") as http:
            for kw in (dict(data=chunks()), dict(data=b"y" * 5000), dict(data=b"{not json"),
                       dict(data=b"{}", headers={**auth, "Content-Encoding": "gzip"})):
                kw.setdefault("headers", auth)
                async with http.post("/v1/completions", **kw) as r:
                    out.append((r.status, r.content_type, (await r.json())["error"]))
        return out

    got = asyncio.run(go())
    assert [(status, err["code"]) for status, _, err in got] == [
        (413, "body_too_large"), (413, "body_too_large"), (400, "invalid_json"), (400, "invalid_body")], got
    assert all(ct == "application/json" and set(err) == {"message", "type", "param", "code"} for _, ct, err in got)


def test_a_real_gateway_answers_aiohttp_errors_and_expect_in_json(real_gw):
    for method, path, body, headers, status in [
        ("GET", "/nope", None, {}, 404),
        ("PUT", "/v1/chat/completions", b"{}", {}, 405),
        ("POST", "/v1/chat/completions", b"y" * 5000, {}, 413),
        ("POST", "/v1/chat/completions", b"{}", {"Expect": "something-else"}, 417),
    ]:
        code, h, raw = real_gw.http(method, path, body, headers)
        _error(raw)
        assert code == status and h["content-type"].startswith("application/json"), (path, code, raw)
    model = real_gw.openai().models.list().data[0].id
    with real_gw.openai().chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, stream=True) as stream:
        assert list(stream)  # streaming is untouched by the middleware


def test_parse_errors_are_not_logged_as_server_errors(real_gw):
    """Every request aiohttp's parser refused was logged as an ERROR with its traceback (aiohttp's
    `logger.exception`; the gateway soak audit found them, scripts/gateway_soak.py), so any client
    could fill `dflash serve`'s log with tracebacks: a client's mistake is now one line at DEBUG,
    and the answer is still the JSON 400."""
    log_path = real_gw.err.name
    before = len(open(log_path, "rb").read())
    for name, (data, _) in UNPARSABLE.items():
        code, _, raw = _parse(_raw(real_gw.port, data))
        assert code == 400 and _error(raw)["code"] == "invalid_http", name
    assert real_gw.http("GET", "/health", key=None)[0] == 200  # served on, and anything it logs is in by now
    added = open(log_path, "rb").read()[before:].decode(errors="replace")
    assert "Traceback" not in added and "Error handling request" not in added, added[:2000]


def test_an_unreadable_body_closes_its_connection_without_a_traceback(real_gw):
    """A body aiohttp cannot decode (gzip that is not): the 400 invalid_body closes the connection,
    which aiohttp's parser never reads again, and logs nothing. The answer was sent as kept alive,
    then aiohttp drained the body, met the error again and logged an "Unhandled exception" (three
    chained tracebacks at ERROR) for every such request; a client that reused the connection was
    reset (found by scripts/gateway_soak.py)."""
    log_path = real_gw.err.name
    before = len(open(log_path, "rb").read())
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 15\r\n\r\n")
    with socket.create_connection(("127.0.0.1", real_gw.port), timeout=30) as s:
        s.sendall(head + b"not gzip at all")  # kept alive: no Connection: close
        reply = b""
        while chunk := s.recv(65536):  # the server closes the connection after the answer
            reply += chunk
    code, headers, raw = _parse(reply)
    assert code == 400 and _error(raw)["code"] == "invalid_body"
    assert headers.get("connection", "").lower() == "close"
    assert real_gw.http("GET", "/health", key=None)[0] == 200
    added = open(log_path, "rb").read()[before:].decode(errors="replace")
    assert "Traceback" not in added and "Unhandled exception" not in added, added[:2000]
