"""The gateway's error answers in OpenAI's shape (`{"error": {message, type, param, code}}`),
also for the answers aiohttp makes itself, outside the application: a request its HTTP parser
refuses and the 417 of its default Expect handler. Split from gateway.py, whose handlers and
middleware make the other errors (openai_schema.ApiError) and answer them with `json_error`.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web

from . import openai_schema as S
from .gateway_metrics import GatewayMetrics

log = logging.getLogger("dflash.gateway")


def json_error(err: S.ApiError) -> web.Response:
    headers = {**({"Retry-After": "1"} if err.status == 429 else {}), **err.headers}
    resp = web.json_response(err.body(), status=err.status, headers=headers or None)
    if err.close:
        resp.force_close()
    return resp


# ----------------------------------------------------------------------------- aiohttp's own answers
# Two kinds of answer are made by aiohttp itself, outside the application, so no middleware sees
# them, and were aiohttp's text/plain:
# * a request its HTTP parser refuses (a broken request line, method, version or header, a bad
#   Content-Length or Transfer-Encoding, a line over 8190 bytes, too many headers, a missing Host,
#   broken chunked framing or a Content-Encoding it cannot decode in what it has read, TLS or
#   HTTP/2 on this plain HTTP/1.1 port): the connection handler's `handle_error` answers it,
#   the request never routed. aiohttp's status is 400 for every one of them (its parser does not
#   say whether an over-long line was the request line, a 414, or a header, a 431), kept here;
# * an HTTPException raised before the middlewares: the only one is the 417 of aiohttp's default
#   Expect handler, for an `Expect` other than 100-continue on a path no route has (the routes
#   have the gateway's own handler, which answers in JSON).
# The gateway's connections are JsonErrorConnection, which answers both in OpenAI's shape with the
# same status, logging and closed connection.
PARSE_MESSAGE_MAX = 300  # characters of aiohttp's parser message kept (it quotes the offending bytes)


def http_exception_error(request: web.BaseRequest, e: web.HTTPException) -> S.ApiError:
    """An aiohttp HTTPException (unknown route, wrong method, a refused Expect, ...) as an OpenAI error."""
    kind = "not_found_error" if e.status == 404 else "server_error" if e.status >= 500 else "invalid_request_error"
    what = f"{e.reason}: {request.method} {request.path}"
    # aiohttp's own text is "<status>: <reason>"; anything else says more, so keep it
    if e.text and e.text != f"{e.status}: {e.reason}":
        what = f"{what}: {e.text}"
    return S.ApiError(e.status, what, kind, code="expectation_failed" if e.status == 417 else None)


def parse_error(status: int, exc: BaseException | None, message: str | None) -> S.ApiError:
    """The OpenAI error for an answer aiohttp's `handle_error` makes: a request its parser refused
    (4xx), or a handler failure that escaped the middlewares (5xx; they catch everything but a
    client that left, so such an answer reaches nobody in practice)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    if status >= 500:
        return S.ApiError(status, f"{phrase}: internal gateway error", "server_error", code="internal")
    text = message or (str(getattr(exc, "message", "") or exc) if exc is not None else "") or phrase
    # aiohttp's parser messages span lines: a description, the offending bytes, a caret under them
    detail = " ".join(ln for ln in (x.strip() for x in text.splitlines()) if ln and set(ln) != {"^"})
    if len(detail) > PARSE_MESSAGE_MAX:
        detail = detail[:PARSE_MESSAGE_MAX] + "..."
    return S.ApiError(status, f"invalid HTTP request: {detail}", "invalid_request_error", code="invalid_http")


class JsonErrorConnection(web.RequestHandler):
    """aiohttp's connection handler (one per TCP connection), answering the errors aiohttp makes
    itself, outside the application, in OpenAI's shape. `metrics`: the gateway's, set on a
    per-gateway subclass (json_connection_errors), which counts each such answer under the route
    "other", as the middleware counts the others."""

    __slots__ = ()  # aiohttp's layout exactly: mix_into_handlers swaps the class of its handlers
    metrics: GatewayMetrics | None = None

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        err = parse_error(status, exc, message)
        if status >= 500:
            super().handle_error(request, status, exc, message)  # aiohttp's logging; raises once an answer began
        else:
            # A request the client got wrong. aiohttp logged each one as an ERROR with the parser's
            # traceback (all but a bad method on a connection's first request), so any client
            # could fill the gateway's log with tracebacks (the soak audit found them): one line at
            # DEBUG instead, as aiohttp logs non-HTTP traffic, and aiohttp's check that no answer began.
            log.debug("invalid HTTP request from %s: %s", request.remote, err.message)
            if request.writer.output_size > 0:
                raise ConnectionError("Response is sent already, cannot send another response "
                                      "with the error message")
            if self.metrics is not None:  # (a 5xx escaped the middleware, which counted it)
                self.metrics.request("other", status)
        resp = json_error(err)
        resp.force_close()  # as aiohttp's: after a parse error the rest of the connection is not trusted
        return resp

    async def finish_response(self, request: Any, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        """Every answer goes out here; an HTTPException raised outside the middlewares (aiohttp's
        default Expect handler's 417) is answered in JSON instead, before anything was written."""
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and request.writer.output_size == 0:
            if self.metrics is not None:
                self.metrics.request("other", resp.status)
            err = http_exception_error(request, resp)
            resp = json_error(err)
            resp.force_close()  # a refused Expect: the body the client holds back is never read
        return await super().finish_response(request, resp, start_time)


def json_connection_errors(server: web.Server, metrics: GatewayMetrics | None = None) -> bool:
    """Make a set-up runner's server's connection handlers JsonErrorConnection ones, counting in
    `metrics`; False, with a warning, where this aiohttp does not allow it: its own errors then
    stay text/plain."""
    return mix_into_handlers(server, JsonErrorConnection, {"metrics": metrics}, "its own errors stay text/plain")


# ----------------------------------------------------------------------------- connection-handler hooks
def mix_into_handlers(server: web.Server, mixin: type[web.RequestHandler], attrs: dict[str, Any], lost: str,
                      needs: tuple[str, ...] = ()) -> bool:
    """Make every connection handler an aiohttp server makes an instance of `mixin` mixed in front
    of the handler's own class, with `attrs` as class attributes: the one home of the gateway's
    hooks into aiohttp's connection handler (JsonErrorConnection here, gateway.py's HeaderDeadline
    and HalfClose). `server` is a set-up runner's `runner.server` (aiohttp makes it from the
    application in `runner.setup()`, and calls it for each accepted connection). aiohttp has no
    setting for its handler class, so the server's class is swapped for a subclass whose `__call__`
    re-classes each handler it makes; Python allows that only between classes of the same layout,
    so `mixin` adds no slot (`__slots__ = ()`, and state it keeps lives in a class attribute).
    Hooks stack: a later call mixes its class in front of an earlier one's.

    `needs`: the names of aiohttp's handler attributes and methods `mixin` relies on. Where this
    aiohttp's handler lacks one of them, or does not allow the swap, the server is left as it is
    and False returned, with a warning ending in `lost` (what the gateway goes without); a handler
    of another class that cannot take the mixin is served without it, with one warning per class."""
    have = {n for c in web.RequestHandler.__mro__ for n in (*getattr(c, "__slots__", ()), *vars(c))}
    missing = [n for n in needs if n not in have]
    if missing:  # another aiohttp than the one the hook was written against (3.14; pyproject keeps it below 3.15)
        log.warning("this aiohttp's connection handler is not the one %s hooks (it has no %s): %s",
                    mixin.__name__, ", ".join(missing), lost)
        return False
    classes: dict[type, type] = {}
    failed: set[type] = set()

    def mixed(base: type) -> type:
        if base not in classes:
            classes[base] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {"__slots__": (), **attrs})
        return classes[base]

    class MixingServer(type(server)):  # type: ignore[misc, valid-type]
        def __call__(self) -> web.RequestHandler:
            handler = super().__call__()
            base = type(handler)
            try:
                handler.__class__ = mixed(base)
            except TypeError as e:  # a handler class of another layout: served without the mixin
                if base not in failed:
                    failed.add(base)
                    log.warning("%s connections cannot take %s (%s): %s", base.__name__, mixin.__name__, e, lost)
            return handler

    try:
        # tried once on aiohttp's own class, so that a mismatch shows when the gateway starts
        web.RequestHandler.__new__(web.RequestHandler).__class__ = mixed(web.RequestHandler)
        server.__class__ = MixingServer
    except TypeError as e:
        log.warning("aiohttp's connection handler cannot take %s (%s): %s", mixin.__name__, e, lost)
        return False
    return True
