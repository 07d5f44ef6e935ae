"""Every HTTP error the gateway answers is OpenAI's error object, aiohttp's own included, and an
error raised after a stream began ends that stream as an error event instead of breaking it.

An in-process gateway (its aiohttp app, on 127.0.0.1) with a stand-in for the daemon client, so
failures a real daemon never produces (a bug mid-stream, an HTTPException raised by a handler)
can be made on purpose; then a real `dflash serve` on a real daemon for aiohttp's own errors."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from dflash.client.client import Delta, Result
from dflash.daemon.config import DaemonConfig
from dflash.daemon.gateway import Gateway


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

    def __init__(self, max_body_bytes: int = 2048):
        self.gw = Gateway("ipc:///nonexistent/dflash-test", DaemonConfig(), max_body_bytes=max_body_bytes)

        async def rows():
            return [{"model": "/models/tiny"}]

        self.gw._model_rows = rows
        self.gw.client = _FakeClient()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.gw.app(), handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
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
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
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
    """Status, lower-cased headers and body (de-chunked) of one HTTP/1.1 answer."""
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
