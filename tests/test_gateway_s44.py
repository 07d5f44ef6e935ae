"""A daemon that stops in the moment between the gateway's model check and its submit (session 44).

The model check reads supervisor.json, so a request sent after the daemon stopped is answered 503
at once (test_gateway_s43); one whose check passed just before the stop used to wait out the
generation client's whole 30 s of re-sending its submit to nobody. An in-process gateway on a real
daemon (supervisor + worker, tiny model), its model check pinned to the answer it had just before
the stop, which is that moment held open."""

from __future__ import annotations

import json
import time

from daemon_fixtures import make_daemon, tiny_pair  # noqa: F401
from test_gateway import MSGS
from test_gateway_errors import _error, _parse, _raw, _request, _Server
from test_gateway_s43 import stop_whole_daemon

from dflash.daemon.gateway import Gateway

CHAT = "/v1/chat/completions"


def _chat(srv: _Server, stream: bool) -> tuple[int, bytes, float]:
    body = json.dumps({"messages": MSGS, "max_tokens": 4, "stream": stream}).encode()
    start = time.monotonic()
    status, _, raw = _parse(_raw(srv.port, _request("POST", CHAT, body, {"Content-Type": "application/json"}), 60))
    return status, raw, time.monotonic() - start


def test_a_daemon_that_stops_after_the_model_check_is_answered_at_once(make_daemon):  # noqa: F811
    d = make_daemon()
    srv = _Server(gw=Gateway(d.endpoint, d.cfg))
    try:
        status, raw, _ = _chat(srv, stream=False)
        assert status == 200, raw  # served: the gateway has seen this daemon's supervisor running
        rows = srv.gw._models[1]

        async def checked_just_before_the_stop():
            return rows

        srv.gw._model_rows = checked_just_before_the_stop
        stop_whole_daemon(d)
        for stream in (False, True):
            status, raw, took = _chat(srv, stream)
            assert status == 503, raw
            err = _error(raw)
            assert err["code"] == "unavailable" and "stopped" in err["message"], err
            assert took < 10, f"took {took:.1f}s to say the daemon stopped (the client's resends: 30 s)"
    finally:
        srv.stop()
