"""`dflash serve`: an OpenAI-compatible HTTP gateway, one more client of dflashd.

HTTP outside (aiohttp), the daemon's protocol inside (AsyncDFlashClient): HTTP users share the
worker's queue and caches with every other client. Request parsing and response shapes live in
openai_schema.py, error answers (aiohttp's own too) in gateway_errors.py, counters in
gateway_metrics.py; docs/gateway.md describes the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import os
import re
import signal
import socket
import time
import uuid
from email.utils import formatdate
from pathlib import Path
from typing import Any, Awaitable, Callable

import click
from aiohttp import compression_utils, hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError

from dflash.client import errors as E
from dflash.client.aio import AsyncDFlashClient
from dflash.client.client import Result
from dflash.daemon import protocol as P

from . import openai_schema as S
from . import paths, supervisor
from .config import DaemonConfig, is_loopback
from .gateway_errors import http_exception_error, json_connection_errors, json_error, mix_into_handlers
from .gateway_metrics import GatewayMetrics

log = logging.getLogger("dflash.gateway")
# Seconds a stopping gateway lets generations in flight run on before it cancels them (and their
# jobs) and answers them 503 shutting_down; aiohttp's own 60 s (twice over) kept `dflash serve`
# streaming for minutes after a Ctrl-C, then cut the connections without a word.
SHUTDOWN_GRACE_S = 1.0
# Seconds a request that finds no worker waits while the daemon's supervisor restarts it
# (docs/gateway.md, "When the daemon fails"); the control client's own 2 s is the wait otherwise.
RESTART_WAIT_S = 30.0
RESTART_POLL_S = 0.1  # how often supervisor.json is read meanwhile
GONE_POLL_S = 0.5  # how often a generation waiting for its first event reads it (_first_event)
GONE_PROBE_S = 0.2  # how often a half-closed connection's socket is read for the reset of a client gone (HalfClose)
MODELS_TTL_S = 5.0  # how long a model check that succeeded stands (while the daemon has not stopped)
# Seconds a request's body may take to arrive, from when its handler starts reading it (after the
# headers, and after a 100 Continue): a client that stops sending it (or trickles it) is answered
# 408 and its connection closed, where it held the connection and its handler for ever
# (--body-timeout).
BODY_TIMEOUT_S = 30.0
# Seconds a request's headers may take to arrive: from when a connection is accepted, and on a
# kept-alive connection from the first byte of its next request. A connection that sends nothing,
# or trickles its headers (slowloris), held the connection for aiohttp's keep-alive timeout (an
# hour), since aiohttp calls no handler until the headers are complete (--header-timeout).
HEADER_TIMEOUT_S = 30.0
# Seconds a kept-alive connection may stay idle between requests before it is closed (aiohttp's
# own default was 3630; --keepalive-timeout).
KEEPALIVE_TIMEOUT_S = 75.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# request key: the response whose headers went out (set by on_response_prepare)
_STARTED: web.RequestKey[web.StreamResponse] = web.RequestKey("dflash_started", web.StreamResponse)

# Daemon error code -> (HTTP status, OpenAI error type).
_STATUS = {
    P.BAD_REQUEST: (400, "invalid_request_error"), P.TOO_LARGE: (413, "invalid_request_error"),
    P.BAD_FRAME: (400, "invalid_request_error"), P.BAD_SAMPLING: (400, "invalid_request_error"),
    P.NOT_FOUND: (404, "not_found_error"), P.BAD_VERSION: (502, "server_error"),
    P.BUSY: (429, "rate_limit_error"), P.NOT_READY: (503, "server_error"),
    P.SHUTTING_DOWN: (503, "server_error"), "unavailable": (503, "server_error"),
    "worker_gone": (503, "server_error"),
}
# Content codings a request body may have (Content-Encoding): those aiohttp's parser decodes, with
# the decoders this install has (br and zstd need packages the gateway does not install; without
# them aiohttp's parser refuses the request itself, 400 invalid_http), and identity (none). A list
# of codings (`gzip, identity`, or the header twice) is not one of them: aiohttp decodes a single
# coding only, and read such a body as it came (gzip bytes answered 400 invalid_json), so it is a
# 415 naming these, as is a coding aiohttp does not know (read as plain JSON before).
CONTENT_CODINGS = ("gzip", "deflate", *(("br",) if getattr(compression_utils, "HAS_BROTLI", False) else ()),
                   *(("zstd",) if getattr(compression_utils, "HAS_ZSTD", False) else ()), "identity")
# Daemon codes whose message is about one field of the request: the answer names it in `param`.
_FIELD_CODES = {P.BAD_REQUEST, P.BAD_SAMPLING, P.TOO_LARGE, P.BAD_POSITIONS}


# Endpoints and filesystem paths in the daemon's messages (its socket, the model's files): the
# HTTP answer says "<endpoint>" / "<path>", the gateway's log keeps the full message.
_ENDPOINT = re.compile(r"\b(?:ipc|tcp|inproc)://[^\s'\"()\[\],;]*[^\s'\"()\[\],;:.]")
_PATH = re.compile(r"(?<![\w/.:<>-])~?(?:\.{1,2})?/[^\s'\"()\[\],;]*[^\s'\"()\[\],;:.]")


_MAX_TOKENS_WORD = re.compile(r"\bmax_tokens\b")


def redact(message: str) -> str:
    """A daemon message with its endpoints and filesystem paths replaced: they describe this
    host, not the request, and an HTTP client (maybe remote) has no use for them."""
    return _PATH.sub("<path>", _ENDPOINT.sub("<endpoint>", message))


def api_error_from(e: E.DFlashError, req: S.GenRequest | None = None) -> S.ApiError:
    """A daemon error in OpenAI's shape; `req` (the request it answers) lets `param` name the
    field as the request spelt it."""
    status, kind = _STATUS.get(e.code, (500, "server_error"))
    message = redact(e.message)
    if message != e.message:
        log.warning("daemon error %s answered as HTTP %d: %s", e.code, status, e.message)
    param = S.request_param(e.param or S.wire_field(e.message), req) if e.code in _FIELD_CODES else None
    return S.ApiError(status, _explain(e, message, req), kind, param, e.code)


def _explain(e: E.DFlashError, message: str, req: S.GenRequest | None) -> str:
    """The daemon's message, with what an HTTP client cannot know: which of the daemon's limits it
    ran into, that a max_tokens it never sent came from this server's default, and max_tokens (or
    a field the codec quotes) by the name the request gave it."""
    if e.code == P.TOO_LARGE:
        return f"the request is too large for the daemon (its max_frame_bytes): {message}; send a shorter prompt"
    wire = e.param or S.wire_field(e.message)
    if req is None or wire != "max_tokens":
        named = S.request_param(wire, req) if req is not None else None
        # the codec quotes the submit's field: chat_template_kwargs read "field 'template_args' ..."
        return message.replace(f"field {wire!r}", f"field {named!r}", 1) if wire and named else message
    if req.max_tokens_param is None:
        return (f"{message}: the request set no max_tokens, and this server's --default-max-tokens is over the "
                "daemon's max_tokens_limit; send max_tokens")
    # The daemon's word is its own field; a chat that set max_completion_tokens (maybe beside a
    # max_tokens that was fine) read "max_tokens must be in 1..N" about a value it never sent there.
    return _MAX_TOKENS_WORD.sub(req.max_tokens_param, message, count=1)


class BodyTimeout(asyncio.TimeoutError):
    """A request body that did not arrive within the gateway's --body-timeout: set on the body's
    stream, so the read fails with it (answered 408). A TimeoutError, so that aiohttp, which after
    the answer would read on for the rest of the body (its lingering close, up to 10 s), stops at
    once and closes the connection."""


def _shutting_down() -> S.ApiError:
    return S.ApiError(503, "the server is shutting down: retry the request", "server_error", code=P.SHUTTING_DOWN)


async def start_runner(gw: "Gateway", **kwargs: Any) -> web.AppRunner:
    """The gateway's app in a set-up aiohttp AppRunner (its sites not started yet), whose
    connections answer aiohttp's own errors in OpenAI's shape too, close when a request's headers
    do not arrive within gw.header_timeout, idle kept-alive for gw.keepalive_timeout at most, and
    answer the requests a client sent before it half-closed the connection."""
    kwargs.setdefault("keepalive_timeout", gw.keepalive_timeout)
    runner = web.AppRunner(gw.app(), **kwargs)
    await runner.setup()
    assert runner.server is not None
    json_connection_errors(runner.server, gw.metrics)
    header_deadlines(runner.server, gw.header_timeout, gw.metrics)
    half_close_answers(runner.server)
    return runner


class HeaderDeadline(web.RequestHandler):
    """A connection handler that closes its connection when a request's headers do not arrive
    within `header_timeout` seconds: counted from when the connection is accepted, and on a
    kept-alive connection from the first byte of its next request (the idle time before that byte
    is aiohttp's keep-alive timeout). A client that sent part of its headers is answered a 408
    request_timeout first; one that sent nothing is closed without a word, as an idle kept-alive
    connection is (a 408 it never asked for could pass for the answer to a request it sends at that
    moment). Mixed into the server's handler class by `header_deadlines`
    (gateway_errors.mix_into_handlers), which sets the class attributes; the timers live in
    `deadlines` (aiohttp's handlers have slots and no room for one)."""

    __slots__ = ()  # aiohttp's layout exactly: the server swaps the class of the handlers it makes
    header_timeout: float = HEADER_TIMEOUT_S
    metrics: GatewayMetrics | None = None
    # handler -> (its timer, whether bytes of the request it waits for arrived)
    deadlines: dict[web.RequestHandler, tuple[asyncio.TimerHandle, bool]] = {}

    def _idle(self) -> bool:
        """start() waits for a request (no handler runs, none is queued): what arrives now is the
        next request's headers."""
        return self._waiter is not None and not self._waiter.done() and not self._messages

    def _arm(self, started: bool) -> None:
        timer = self._loop.call_later(self.header_timeout, self._headers_late)
        self.deadlines[self] = (timer, started)

    def _disarm(self) -> None:
        entry = self.deadlines.pop(self, None)
        if entry is not None:
            entry[0].cancel()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.transport is not None:
            self._arm(False)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        idle, queued = self._idle(), len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # a request's headers are complete (or refused: a 400)
            self._disarm()
        elif idle and data.strip(b"\r\n") and self._idle():  # part of the next request's headers
            # (empty lines between requests are ignored, RFC 9112 2.2: some clients send a CRLF
            # after a body, which armed the deadline and drew a 408 nobody asked for)
            entry = self.deadlines.get(self)
            if entry is None:
                self._arm(True)
            elif not entry[1]:
                self.deadlines[self] = (entry[0], True)

    def _process_keepalive(self) -> None:
        # aiohttp's keep-alive timer closes a connection that waits for a request; one whose request
        # has begun to arrive is this class's deadline's (aiohttp sets the timer again after it).
        entry = self.deadlines.get(self)
        if entry is not None and entry[1]:
            self._keepalive_handle = None
            return
        super()._process_keepalive()

    def _headers_late(self) -> None:
        entry = self.deadlines.pop(self, None)
        if entry is None or self.transport is None or not self._idle():
            return
        if entry[1]:
            err = S.ApiError(408, f"the request headers did not arrive within {self.header_timeout:g} s (this "
                             "server's --header-timeout): send the whole request without pausing",
                             code="request_timeout")
            body = json.dumps(err.body()).encode()
            head = ("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json; charset=utf-8\r\n"
                    f"Content-Length: {len(body)}\r\nDate: {formatdate(usegmt=True)}\r\nConnection: close\r\n\r\n")
            self.transport.write(head.encode("ascii") + body)
            if self.metrics is not None:
                self.metrics.request("other", 408)
            log.debug("request headers from %s late (--header-timeout): answered 408", self.peername)
        self.force_close()  # the transport closes once the answer is written


def header_deadlines(server: web.Server, timeout: float, metrics: GatewayMetrics | None = None) -> bool:
    """Make a set-up runner's server's connection handlers HeaderDeadline ones, with `timeout`
    (gateway_errors.mix_into_handlers); False, with a warning, where this aiohttp's handler is not
    the one the hook reads: request headers then have no deadline."""
    return mix_into_handlers(server, HeaderDeadline, {"header_timeout": timeout, "deadlines": {}, "metrics": metrics},
                             "request headers have no deadline (only --keepalive-timeout)",
                             needs=("_waiter", "_messages", "_loop", "_keepalive_handle", "_process_keepalive"))


class BodyCut(web.RequestPayloadError):
    """A request body that the client's half-close ended before it was whole (HalfClose): set on
    the body's stream, so the read fails with it (answered 400 invalid_body)."""


class HalfClose(web.RequestHandler):
    """A connection handler that answers the request a client sent before it shut down its
    sending side (a FIN: `shutdown(SHUT_WR)`, a half-close, as some HTTP/1.1 clients and load
    balancers do once their request is out), then closes the connection. aiohttp's handler lets
    asyncio close the whole connection at the FIN, so such a request got no answer at all. A
    request whose body the FIN cut short fails its body read at once (BodyCut: a 400, not a
    --body-timeout 408 later); a connection with no request left to answer (it sent nothing, part
    of a request's headers, or waits between kept-alive requests) is still closed at the FIN.
    A client that closes its connection altogether (it gave up) sends the same FIN, and TCP tells
    the two apart only once something is written to it: so at the FIN, where the answer has not
    begun, the gateway writes an interim `100 Continue` (RFC 9110 15.2: an HTTP/1.1 client must
    take any number of 1xx before the final answer), which a closed socket answers with a reset;
    the socket's error, read every GONE_PROBE_S, then aborts the connection and cancels the
    handler (serve's handler_cancellation), and with it the job, as at any disconnect. So only an
    HTTP/1.1 request that is the last one sent is kept past the FIN: an HTTP/1.0 one may not be
    sent a 1xx (nginx speaks HTTP/1.0 to its upstream by default and closes when its client
    aborts), and requests pipelined behind another would go unprobed until answered; both close
    at the FIN as before, so an abandoned generation is cancelled at once (the review of session
    49 found them run to their end). A client that gives up after the probe, or whose answer had
    begun (a stream: its next event finds it), is noticed when the answer is written. Mixed into
    the server's handler class by `half_close_answers`; what it counts per connection lives in
    `books` (aiohttp's handlers have slots and no room)."""

    __slots__ = ()  # aiohttp's layout exactly: the server swaps the class of the handlers it makes
    # handler -> [requests answered, the last request parsed (message, body), whether the FIN
    # came, whether an answer is being written]
    books: dict[web.RequestHandler, list] = {}

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # requests parsed: the last one's body is the one still arriving
            self.books.setdefault(self, [0, None, False, False])[1] = self._messages[-1]

    def eof_received(self) -> bool | None:
        book = self.books.get(self)
        # requests parsed (aiohttp counts them) and not answered yet
        if (self._upgraded or self._payload_parser is not None or book is None or book[1] is None
                or self._request_count <= book[0]):
            return None  # nothing asked and not answered: asyncio closes the connection, as before
        msg, body = book[1]
        version = getattr(msg, "version", None)  # None: a line the parser refused, its 400 on the way
        if (version is not None and version != HttpVersion11) or self._request_count > book[0] + 1:
            return None  # HTTP/1.0, or requests pipelined behind another: no probe, closed as before
        book[2] = True
        if not body.is_eof() and self._parser is not None:  # its parser is in that body
            try:
                self._parser.feed_eof()  # ends the body where all of it is in, else says what is missing
            except HttpProcessingError as e:
                body.set_exception(BodyCut(f"the client closed its side of the connection before the request "
                                           f"body ended: {str(e.message or e).strip()}"))
        current = self._current_request  # None: its handler has not started yet, or has returned
        begun = book[3] or (current is not None and current.writer.output_size > 0)
        if version == HttpVersion11 and not begun and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # a closed socket answers it with a reset
            self._loop.call_later(GONE_PROBE_S, self._gone)
        return True  # the connection stays open for the answer

    def _gone(self) -> None:
        """Aborts the connection where the probe at the FIN was answered with a reset (the client
        had closed it altogether); else looks again in GONE_PROBE_S, until the connection closes."""
        if self.transport is None or self not in self.books:
            return
        sock = self.transport.get_extra_info("socket")
        try:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock is not None else 0
        except OSError as e:
            err = e.errno or -1
        if err:
            log.debug("the client at %s left after its half-close (%s): cancelled", self.peername, os.strerror(err))
            self.transport.abort()  # connection_lost: aiohttp cancels the handler
        else:
            self._loop.call_later(GONE_PROBE_S, self._gone)

    async def finish_response(self, request: Any, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        book = self.books.setdefault(self, [0, None, False, False])
        if book[2] and self._request_count == book[0] + 1 and not resp.prepared:
            resp.force_close()  # the last request the client sent: say the connection closes after it
        book[3] = True  # being written: a FIN now gets no interim 100 (it would follow the answer)
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            book[0] += 1
            book[3] = False
            if self._request_count == book[0]:
                book[1] = None  # all answered: the last request's body buffer is not kept alive
                if book[2]:
                    self.force_close()  # closes once the answer is written; aiohttp reads no rest of a body

    def connection_lost(self, exc: BaseException | None) -> None:
        self.books.pop(self, None)
        super().connection_lost(exc)


def half_close_answers(server: web.Server) -> bool:
    """Make a set-up runner's server's connection handlers HalfClose ones
    (gateway_errors.mix_into_handlers); False, with a warning, where this aiohttp's handler is not
    the one the hook reads: a request then a half-close get no answer, as before."""
    return mix_into_handlers(server, HalfClose, {"books": {}},
                             "a request followed by a half-close (FIN) is not answered",
                             needs=("_messages", "_request_count", "_parser", "_upgraded", "_payload_parser",
                                    "_current_request", "_loop", "data_received", "eof_received", "finish_response",
                                    "force_close", "peername"))


class Gateway:
    """The aiohttp application and the state it shares across requests."""

    def __init__(self, endpoint: str, cfg: DaemonConfig, *, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, default_max_tokens: int = 512,
                 sampling: str = "apply", model_name: str | None = None,
                 default_sampling: dict[str, Any] | None = None, body_timeout: float = BODY_TIMEOUT_S,
                 header_timeout: float = HEADER_TIMEOUT_S, keepalive_timeout: float = KEEPALIVE_TIMEOUT_S):
        self.client = AsyncDFlashClient(endpoint, config=cfg, timeout=30.0)
        self.control = AsyncDFlashClient(endpoint, config=cfg, timeout=2.0, retry_interval=1.0)
        self.endpoint, self.run_dir = endpoint, cfg.runtime_path()  # where the daemon's supervisor says how it is
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.header_timeout, self.keepalive_timeout = header_timeout, keepalive_timeout
        self.default_max_tokens = default_max_tokens
        # "apply": sampling applied, unapplied fields (none today) ignored and listed in a header;
        # "reject": those are a 400 instead; "greedy": every answer greedy, sampling fields listed.
        self.sampling = sampling
        # For requests that leave temperature / top_p / top_k / min_p / min_tokens_to_keep out (None
        # here: the daemon's default).
        self.default_sampling = {k: v for k, v in (default_sampling or {}).items() if v is not None}
        self.model_name = model_name
        self.metrics = GatewayMetrics()
        self._models: tuple[float, list[dict]] | None = None
        self._supervised = False  # a live supervisor in run_dir was seen serving this endpoint
        self.closing = False  # set when the server stops
        self._inflight: set[asyncio.Task] = set()  # handlers running a generation
        self._stopped: set[asyncio.Task] = set()  # those the stop cancelled (answered 503 shutting_down)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors, self._auth])
        # aiohttp answers an Expect header before any middleware runs: ours answers in JSON too
        expect = {"expect_handler": self._expect}
        app.router.add_post("/v1/chat/completions", self._chat, **expect)
        app.router.add_post("/v1/completions", self._completions, **expect)
        app.router.add_get("/v1/models", self._list_models, **expect)
        app.router.add_get("/v1/models/{model:.+}", self._get_model, **expect)
        app.router.add_get("/health", self._health, **expect)
        app.router.add_get("/metrics", self._metrics, **expect)
        app.on_response_prepare.append(self._started)
        app.on_shutdown.append(self._stopping)
        app.on_cleanup.append(self._close)
        return app

    async def _stopping(self, _app: web.Application) -> None:
        """Before aiohttp's own shutdown (which cancels handlers only once it has closed their
        connections): give generations a moment, then cancel them here, while their clients can
        still be told why and their jobs cancelled in the daemon."""
        self.closing = True
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=SHUTDOWN_GRACE_S)
        for task in pending:
            self._stopped.add(task)
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)

    def _cancelled_by_stop(self) -> bool:
        """Whether the CancelledError being handled is the stop's (then the request is answered,
        not dropped); a client that left still just cancels."""
        task = asyncio.current_task()
        if task is None or task not in self._stopped:
            return False
        self._stopped.discard(task)
        if hasattr(task, "uncancel"):  # 3.11+: the cancel is handled, not pending
            task.uncancel()
        return True

    async def _close(self, _app: web.Application) -> None:
        self.client.close()
        self.control.close()

    # ------------------------------------------------------------------ middlewares
    @staticmethod
    async def _started(request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: note the response whose headers are going out, so an error
        raised after that (mid-stream) is not answered with a second response."""
        request.setdefault(_STARTED, response)

    def _error_for(self, request: web.Request, e: Exception) -> S.ApiError:
        """Any exception a handler raised, as an OpenAI error (logged when it is a bug)."""
        if isinstance(e, S.ApiError):
            return e
        if isinstance(e, E.DFlashError):
            return api_error_from(e)
        if isinstance(e, web.HTTPRequestEntityTooLarge):
            return S.ApiError(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        if isinstance(e, web.HTTPException):
            return http_exception_error(request, e)
        log.error("gateway error on %s", request.path, exc_info=e)  # a bug here: answer 500, keep serving
        return S.ApiError(500, f"internal gateway error: {type(e).__name__}", "server_error", code="internal")

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure in OpenAI's error shape (aiohttp's own HTTPExceptions included: unknown
        route, wrong method, body too large); counts each answer for /metrics. An error after a
        stream's headers went out cannot change its status: it ends the stream as an error event."""
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            if e.status < 400 and _STARTED not in request:
                raise  # a redirect or such is an answer, not an error
            resp = await self._error_answer(request, e)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.request(route, 499)  # the client went away
            raise
        except Exception as e:
            resp = await self._error_answer(request, e)
        self.metrics.request(route, resp.status)
        return resp

    async def _error_answer(self, request: web.Request, e: Exception) -> web.StreamResponse:
        err = self._error_for(request, e)
        started = request.get(_STARTED)
        if started is None:
            resp = json_error(err)
            allow = e.headers.get("Allow") if isinstance(e, web.HTTPException) else None
            if allow is not None:  # a 405 must say which methods the route takes (RFC 9110)
                resp.headers["Allow"] = allow
            return resp
        if started.content_type != "text/event-stream":
            raise e  # no such response here; aiohttp drops the connection: the body is cut, visibly
        # The stream's headers (200) are gone: end it as a stream the daemon cut ends.
        with contextlib.suppress(ConnectionError, RuntimeError):  # RuntimeError: it had already ended
            await started.write(b"data: " + json.dumps(err.body(), separators=(",", ":")).encode() + b"\n\n")
            await started.write(b"data: [DONE]\n\n")
            await started.write_eof()
        return started

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """The routes' Expect handler (aiohttp runs it before the middlewares, so it answers in
        JSON itself): 100-continue, unless the declared body is already over the cap; any other
        expectation is a 417."""
        if request.version != HttpVersion11:
            return None  # HTTP/1.0 has no interim responses: read the body as usual
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        expect = request.headers.get(hdrs.EXPECT, "")
        err = None
        if expect.lower() != "100-continue":
            err = S.ApiError(417, f"Expectation Failed: unsupported Expect header {P.shown(expect)} "
                             "(only 100-continue)", code="expectation_failed")
        elif request.content_length is not None and request.content_length > self.max_body_bytes:
            err = S.ApiError(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        if err is not None:
            self.metrics.request(route, err.status)
            resp = json_error(err)
            resp.force_close()  # the body the client holds back is never read
            return resp
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # an interim response: the answer itself has not started
        return None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key and request.path != "/health":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # surrogatepass: a header with undecodable bytes is a wrong key, not a crash
            given = token.strip().encode("utf-8", "surrogatepass")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.api_key.encode("utf-8", "surrogatepass")):
                err = S.ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 "invalid_request_error", None, "invalid_api_key")
                err.headers["WWW-Authenticate"] = "Bearer"  # a 401 must say which scheme (RFC 9110 15.5.2)
                raise err
        return await handler(request)

    # ------------------------------------------------------------------ generation
    async def _body(self, request: web.Request) -> Any:
        _check_content_coding(request)
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=request.content_length)
        # The deadline fails the body's stream itself, with no task of its own (asyncio.wait_for's,
        # on 3.10-3.11, turned a client that left while its body was read into a ConnectionResetError
        # that aiohttp logged as an error, where this read is cancelled quietly).
        timer = asyncio.get_running_loop().call_later(self.body_timeout, request.content.set_exception,
                                                      BodyTimeout())
        try:
            raw = await request.read()
        except BodyTimeout:
            raise S.ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s (this server's "
                             "--body-timeout): send the whole body without pausing", code="request_timeout",
                             close=True) from None
        except web.RequestPayloadError as e:  # e.g. a gzip body that does not decompress: the client's error
            # aiohttp's parser stops for good at such a body (the rest of the connection is never
            # read): the answer closes the connection, and the body is ended here, or aiohttp drained
            # it after the answer, met the error again and logged an "Unhandled exception" (three
            # chained tracebacks at ERROR) for every such request (found by scripts/gateway_soak.py)
            request.content.feed_eof()
            encoding = request.headers.get("Content-Encoding")
            how = f": {e}" if isinstance(e, BodyCut) else f" (Content-Encoding: {encoding})" if encoding else ""
            raise S.ApiError(400, f"could not read the request body{how}", code="invalid_body",
                             close=True) from None
        finally:
            timer.cancel()
        try:
            body = S.loads(raw)
        except RecursionError:  # the parser recursed on deep nesting ([[[[...)
            raise S.bad(f"the JSON body nests deeper than {S.MAX_DEPTH} levels", None, "invalid_json") from None
        except ValueError as e:  # includes UnicodeDecodeError
            raise S.ApiError(400, f"could not parse the JSON body: {e}", code="invalid_json") from None
        S.check_json(body)
        return body

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """One generation, known to the stop (see _stopping) while it runs."""
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            return await self._generation(request, kind)
        except asyncio.CancelledError:  # a stream the stop cut has been answered in _sse
            if self._cancelled_by_stop():
                raise _shutting_down() from None
            raise
        finally:
            self._inflight.discard(task)

    async def _generation(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await self._body(request)
        parse = S.parse_chat if kind == "chat" else S.parse_completion
        req = parse(body, self.default_max_tokens)
        model = await self._check_model(req.model)
        sampling, ignored = self._sampling(req)
        job_id = uuid.uuid4().hex
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + job_id
        headers = {"x-dflash-job-id": job_id}
        if ignored:
            headers["x-dflash-sampling-ignored"] = ",".join(ignored)
        kw: dict[str, Any] = dict(job_id=job_id, raw=req.raw, max_tokens=req.max_tokens, stop=req.stop, **sampling)
        if req.template_args:
            kw["template_args"] = req.template_args
        if req.verify_window is not None:
            kw["verify_window"] = req.verify_window
        events = self.client.stream(req.prompt, **kw)
        async with contextlib.aclosing(events):  # leaving early (disconnect, error) cancels the job
            try:
                first = await self._first_event(events)  # daemon errors up to here still get a proper status
                ctx = (kind, rid, int(time.time()), model)
                if req.stream:
                    return await self._sse(request, req, ctx, first, events, headers, job_id)
                ev = first
                while not isinstance(ev, Result):
                    ev = await anext(events)
            except E.DFlashError as e:
                err = api_error_from(e, req)
                if e.job_id:  # about a job the daemon took (kept after worker_gone): name it, as answers do
                    err.headers["x-dflash-job-id"] = job_id
                raise err from None
            self.metrics.job(ev.stats, ev.finish_reason)
            return web.json_response(S.response(*ctx, ev.text, ev.finish_reason, ev.stats, job_id), headers=headers)

    async def _first_event(self, events: Any) -> Any:
        """A job's first event, watched: when the supervisor this gateway saw serving the daemon
        says it has stopped (it stopped after the model check, whose own read of supervisor.json
        misses that moment), the wait ends at once in a 503, not after the generation client's
        30 s of re-sending the submit to nobody. Once the worker has the job its heartbeats
        tell whether it still runs (the client's worker_gone)."""
        nxt = asyncio.ensure_future(anext(events))
        try:
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=GONE_POLL_S)
                if done:
                    return nxt.result()
                if self._stopped_since():
                    raise E.WorkerUnavailableError("unavailable", f"the dflash daemon at {self.endpoint} stopped "
                                                   "before it took the request (is `dflashd start` running?)")
        finally:
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, E.DFlashError):
                    await nxt

    def _sampling(self, req: S.GenRequest) -> tuple[dict[str, Any], list[str]]:
        """The sampling to submit (request, else this gateway's defaults; what neither sets is
        left to the daemon's config) and the fields that were sent but will not be applied."""
        if self.sampling == "greedy":
            asked = [k for k, on in (("temperature", (req.temperature or 0) > 0), ("top_p", (req.top_p or 1) < 1),
                                     ("top_k", (req.top_k or 0) > 1), ("min_p", (req.min_p or 0) > 0),
                                     ("min_tokens_to_keep", (req.min_tokens_to_keep or 1) > 1)) if on]
            return {"temperature": 0.0, **req.processors}, asked + req.unapplied  # processors: deterministic
        if req.unapplied and self.sampling == "reject":
            raise S.bad(f"this server does not apply {', '.join(req.unapplied)}: leave them out or at their "
                        "neutral values", req.unapplied[0],
                        "unsupported_sampling")
        return {**self.default_sampling, **req.sampling()}, req.unapplied

    async def _sse(self, request: web.Request, req: S.GenRequest, ctx: tuple, first: Any, events: Any,
                   headers: dict, job_id: str) -> web.StreamResponse:
        """Server-sent events: chunks as deltas arrive, the finish, usage if asked, then [DONE]."""
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            await resp.write(f"data: {data}\n\n".encode())

        try:
            if ctx[0] == "chat":
                await send(S.chunk(*ctx, role=True))
            ev = first
            while not isinstance(ev, Result):
                if ev.text:
                    await send(S.chunk(*ctx, text=ev.text))
                ev = await anext(events)
            self.metrics.job(ev.stats, ev.finish_reason)
            await send(S.chunk(*ctx, reason=ev.finish_reason or "stop"))
            if req.include_usage:
                await send(S.usage_chunk(*ctx, ev.stats, job_id))
            await send("[DONE]")
        except E.DFlashError as e:  # headers are gone: the error travels as an event
            await send(api_error_from(e, req).body())
            await send("[DONE]")
        except ConnectionResetError:  # the client left: leaving here cancels the job
            return resp
        except asyncio.CancelledError:  # the client left, or the gateway stops: its job is cancelled
            if not self._cancelled_by_stop():
                raise
            with contextlib.suppress(ConnectionResetError):  # ends like a stream the daemon cut
                await send(_shutting_down().body())
                await send("[DONE]")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ models, health, metrics
    async def _model_rows(self) -> list[dict]:
        if self._models is None or time.monotonic() - self._models[0] > MODELS_TTL_S or self._stopped_since():
            rows = await self._through_restart(self.control.models)
            self._models = (time.monotonic(), rows)
            self._worker_state()  # notes a local supervisor, for _stopped_since
        return self._models[1]

    def _stopped_since(self) -> bool:
        """Whether the supervisor this gateway saw serving the daemon has stopped: the cached model
        check no longer stands, and asking again answers 503 at once (a generation sent to a
        stopped daemon waited the generation client's whole 30 s). A daemon with no supervisor
        here (a remote tcp:// endpoint) is "gone" from the start: its cached check stands."""
        return self._supervised and self._worker_state() == "gone"

    def _worker_state(self) -> str:
        """The daemon's supervisor's word on its worker (supervisor.worker_state): "running",
        "restarting" or "gone" (also a daemon with no supervisor in this runtime dir)."""
        state = supervisor.worker_state(self.run_dir, self.endpoint)
        self._supervised = self._supervised or state != "gone"
        return state

    async def _through_restart(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A control call that, when no worker answers but the supervisor is restarting it (or one
        runs that does not answer yet: loading, or dead and not reaped), waits for it up to
        RESTART_WAIT_S, reading supervisor.json until a worker runs, then asks again. A daemon that
        is gone is answered at once (WorkerUnavailableError after the control client's 2 s)."""
        end = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return await call()
            except E.WorkerUnavailableError:
                state = self._worker_state()
                if state == "gone" or time.monotonic() >= end:
                    raise
                if state == "restarting":
                    log.info("no worker answered; the supervisor is restarting it: waiting up to %.0fs",
                             end - time.monotonic())
                while state == "restarting" and time.monotonic() < end:
                    await asyncio.sleep(RESTART_POLL_S)
                    state = self._worker_state()

    def _model_id(self, row: dict) -> str:
        return self.model_name or Path(str(row.get("model") or "dflash")).name

    async def _check_model(self, name: str | None) -> str:
        """The model id to answer with; 404 for a model this daemon does not serve."""
        rows = await self._model_rows()
        ids = [self._model_id(r) for r in rows]
        if name is None or name in ids or any(name == str(r.get("model")) for r in rows):
            return ids[0] if ids else (name or "dflash")
        raise S.ApiError(404, f"The model {P.shown(name)} does not exist; this server serves {', '.join(ids)}",
                         "invalid_request_error", "model", "model_not_found")

    def _model_object(self, row: dict) -> dict:
        return {"id": self._model_id(row), "object": "model", "created": int(self.metrics.started), "owned_by": "dflash",
                "dflash": {k: row.get(k) for k in ("loaded", "model", "draft", "block_size", "dtype")}}

    async def _list_models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object(r) for r in await self._model_rows()]})

    async def _get_model(self, request: web.Request) -> web.Response:
        """One model by id (the openai client's models.retrieve); 404 model_not_found otherwise."""
        name = request.match_info["model"]
        rows = await self._model_rows()
        for row in rows:
            if name == self._model_id(row):
                return web.json_response(self._model_object(row))
        raise S.ApiError(404, f"The model {P.shown(name)} does not exist; this server serves "
                         f"{', '.join(self._model_id(r) for r in rows)}", "invalid_request_error", "model",
                         "model_not_found")

    async def _daemon_stats(self) -> dict | None:
        try:
            return await self.control.stats()
        except E.DFlashError:
            return None

    async def _health(self, _request: web.Request) -> web.Response:
        """200 while the worker is ready; else 503 at once, "restarting" while the supervisor
        restarts it (a probe must not wait for it as requests do)."""
        st = None if self._worker_state() == "restarting" else await self._daemon_stats()
        if st is not None:
            state = st["state"]
        else:  # (the worker may have died during the stats call: ask the supervisor again)
            state = "restarting" if self._worker_state() == "restarting" else "unavailable"
        body = {"status": "ok" if state == "ready" else "unavailable", "worker": state,
                "queued": st.get("queued") if st else None}
        return web.json_response(body, status=200 if state == "ready" else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        st = await self._daemon_stats()
        if request.query.get("format") == "json":
            return web.json_response(self.metrics.as_json(st))
        return web.Response(text=self.metrics.prometheus(st), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})


def _check_content_coding(request: web.Request) -> None:
    """A 415 for a body whose Content-Encoding aiohttp did not decode: a list of codings (one
    header or several) or a coding it does not know (see CONTENT_CODINGS). Its body is not read
    (the answer closes the connection); `Accept-Encoding` says what is taken (RFC 7694)."""
    given = request.headers.getall(hdrs.CONTENT_ENCODING, [])
    codings = [c.strip().lower() for v in given for c in v.split(",") if c.strip()]
    if len(given) <= 1 and len(codings) <= 1 and set(codings) <= set(CONTENT_CODINGS):
        return
    shown = P.shown(", ".join(v.strip() for v in given))
    why = "a list of codings is not decoded" if len(given) > 1 or len(codings) > 1 else "unknown coding"
    err = S.ApiError(415, f"unsupported Content-Encoding {shown} ({why}): send the body with one of "
                     f"{', '.join(CONTENT_CODINGS)}", code="unsupported_content_encoding", close=True)
    err.headers["Accept-Encoding"] = ", ".join(CONTENT_CODINGS)
    raise err


# ----------------------------------------------------------------------------- running it


# Why a bind failed, in the user's terms (asyncio's own text repeats the address as a tuple).
_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use (another server? pick --port, or --port 0 for a free one)",
    errno.EACCES: "permission denied (ports below 1024 need privileges: pick another --port)",
    errno.EADDRNOTAVAIL: "that address is not one of this machine's (check --host)",
}


def listen_error(host: str, port: int, e: OSError) -> click.ClickException:
    """The one-line error for a host:port the gateway cannot listen on."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    why = _BIND_REASONS.get(e.errno or 0)
    if why is None:  # errno < 0: a host name that does not resolve (socket.gaierror)
        text = os.strerror(e.errno) if e.errno and e.errno > 0 else str(e.strerror or e)
        why = text[:1].lower() + text[1:]
    return click.ClickException(f"cannot listen on {where}: {why}")


async def _probe(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host, port)
    server.close()
    await server.wait_closed()


def check_port(host: str, port: int) -> None:
    """Bind host:port and let go at once, so a port that is taken is refused before a daemon is
    started for nothing (the real bind still reports a port taken in between)."""
    if port == 0:
        return
    try:
        asyncio.run(_probe(host, port))
    except OSError as e:
        raise listen_error(host, port, e) from None


async def run_gateway(gw: Gateway, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Serve until SIGINT/SIGTERM. A client that disconnects cancels its handler (and so its job).
    A host:port it cannot listen on is a ClickException (one line), after cleaning up."""
    runner = await start_runner(gw, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise listen_error(host, port, e) from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before announcing: a prompt SIGTERM is handled too
            loop.add_signal_handler(sig, stop.set)
        addr = runner.addresses[0]
        on_ready(f"http://{addr[0] if ':' not in addr[0] else f'[{addr[0]}]'}:{addr[1]}")
        await stop.wait()
    finally:
        await runner.cleanup()


def default_max_tokens_for(value: int, given: bool, limit: int) -> int:
    """The max_tokens for requests that set none. Over the daemon's max_tokens_limit every such
    request would be refused, so the built-in default is lowered to the limit, and a value given
    on the command line is a usage error."""
    if value <= limit:
        return value
    if given:
        raise click.BadParameter(f"{value} is over the daemon's max_tokens_limit ({limit}): every request "
                                 "without max_tokens would be refused", param_hint="--default-max-tokens")
    return limit


def _daemon_options(f: Any) -> Any:
    from .cli import _config_options

    return _config_options(f)


@click.command("serve")
@_daemon_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (non-loopback needs --api-key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option("--api-key", envvar="DFLASH_API_KEY", default=None, help="Require 'Authorization: Bearer KEY' (env DFLASH_API_KEY).")
@click.option("--served-model-name", default=None, help="Model id in /v1/models (default: the model directory's name).")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1024), help="Request body cap.")
@click.option("--body-timeout", default=BODY_TIMEOUT_S, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds a request body may take to arrive; a client that stalls is answered 408.")
@click.option("--header-timeout", default=HEADER_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds a request's headers may take to arrive (from the connection, or from the first byte "
                   "of a kept-alive connection's next request); then the connection is closed (408 if some came).")
@click.option("--keepalive-timeout", default=KEEPALIVE_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds a kept-alive connection may stay idle between requests before it is closed.")
@click.option("--default-max-tokens", default=512, show_default=True, type=click.IntRange(1), help="When a request sets none.")
@click.option("--sampling", type=click.Choice(["apply", "reject", "greedy"]), default="apply", show_default=True,
              help="apply: sampling (temperature/top_p/top_k/min_p/min_tokens_to_keep/seed) and logits processors "
                   "(logit_bias, penalties) applied; a field that is not would be ignored and listed in "
                   "x-dflash-sampling-ignored. reject: such a field is a 400. greedy: every answer greedy "
                   "(processors still applied), the sampling fields sent listed in the header.")
@click.option("--default-temperature", type=click.FloatRange(min=0), default=None,
              help="For requests without a temperature (default: the daemon's [generation] temperature, normally 0).")
@click.option("--default-top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="For requests without top_p (default: the daemon's, normally 1).")
@click.option("--default-top-k", type=click.IntRange(min=0), default=None,
              help="For requests without top_k (default: the daemon's, normally 0 = off).")
@click.option("--default-min-p", type=click.FloatRange(0, 1), default=None,
              help="For requests without min_p (default: the daemon's, normally 0 = off).")
@click.option("--default-min-tokens-to-keep", type=click.IntRange(min=1), default=None,
              help="For requests without min_tokens_to_keep (default: the daemon's, normally 1).")
@click.option("--attach", is_flag=True, help="Only attach to a running daemon; never start one.")
@click.option("--stop-daemon", is_flag=True, help="Stop the daemon on exit if this command started it.")
@click.option("--wait", "wait_s", default=120.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds to wait for a started daemon's model.")
@click.pass_context
def serve_command(ctx, config_path, host, port, api_key, served_model_name, max_body_bytes, body_timeout,
                  header_timeout, keepalive_timeout, default_max_tokens,
                  sampling, default_temperature, default_top_p, default_top_k, default_min_p,
                  default_min_tokens_to_keep, attach, stop_daemon, wait_s, **flags):
    """OpenAI-compatible HTTP API over dflashd (starts the daemon, or attaches to a running one)."""
    from . import cli as dcli

    paths.private_umask()  # a daemon it starts, and anything it writes, stays private

    if not is_loopback(host) and not api_key:
        raise click.ClickException(f"binding {host} (not loopback) needs --api-key (or DFLASH_API_KEY)")
    problem = P.sampling_problem(default_temperature, default_top_p, default_top_k, min_p=default_min_p,
                                 min_tokens_to_keep=default_min_tokens_to_keep)
    if problem is not None:
        raise click.BadParameter(problem[1], param_hint=f"--default-{problem[0].replace('_', '-')}")
    cfg = dcli._resolve(config_path, **flags)
    given = ctx.get_parameter_source("default_max_tokens") is not click.core.ParameterSource.DEFAULT
    default_max_tokens = default_max_tokens_for(default_max_tokens, given, cfg.max_tokens_limit)
    check_port(host, port)  # before a daemon is started for a gateway that could not listen
    started = False
    stats = dcli._stats(cfg, 1.0)
    if stats is None:
        if attach:
            raise click.ClickException(f"no dflashd answers at {cfg.resolved_endpoint()} (--attach given)")
        ctx.invoke(dcli.start, config_path=config_path, foreground=False, wait_s=wait_s, **flags)
        started = True
    elif not given:  # the running daemon's own limit: its configuration need not be this command's
        limit = (stats.get("limits") or {}).get("max_tokens_limit")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
            default_max_tokens = min(default_max_tokens, limit)
    logging.basicConfig(level=os.environ.get("DFLASH_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    gw = Gateway(cfg.resolved_endpoint(), cfg, api_key=api_key, max_body_bytes=max_body_bytes,
                 default_max_tokens=default_max_tokens, sampling=sampling, model_name=served_model_name,
                 body_timeout=body_timeout, header_timeout=header_timeout, keepalive_timeout=keepalive_timeout,
                 default_sampling={"temperature": default_temperature, "top_p": default_top_p, "top_k": default_top_k,
                                   "min_p": default_min_p, "min_tokens_to_keep": default_min_tokens_to_keep})

    def ready(url: str) -> None:
        click.echo(f"dflash serve: listening on {url} (daemon at {cfg.resolved_endpoint()})", err=False)

    try:
        asyncio.run(run_gateway(gw, host, port, ready))
    finally:
        if started and stop_daemon:
            ctx.invoke(dcli.stop, config_path=config_path, timeout=30.0, **flags)
