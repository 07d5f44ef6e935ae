"""A hardening audit of `dflash serve`'s request fields: each test is a request the gateway
refused, or answered in words the client never used, though the docs and the gateway's own rules
for the other fields say otherwise. A real daemon, a real `dflash serve` process, real sockets
on 127.0.0.1, the tiny real model; raw HTTP."""

from __future__ import annotations

import json

import pytest
from daemon_fixtures import running, tiny_pair  # noqa: F401
from test_gateway import KEY, MSGS, Gateway, _error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, verify_window="full")  # greedy answers repeat exactly


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon, "--api-key", KEY, "--default-max-tokens", "16") as g:
        yield g


def _answer(gw: Gateway, path: str, body: dict) -> dict:
    status, _, raw = gw.http("POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def test_max_tokens_written_as_an_integral_float_is_served(gw):
    """`"max_tokens": 3.0` (a client that writes every number as a float) was a 400 invalid_type,
    where seed, top_k, n and the context sizes take `7.0`: now it is 3 tokens, as `3` is."""
    for path, base, field in ((CHAT, {"messages": MSGS}, "max_tokens"),
                              (CHAT, {"messages": MSGS}, "max_completion_tokens"),
                              (COMPLETIONS, {"prompt": "Tell me about the sea."}, "max_tokens")):
        want = _answer(gw, path, {**base, field: 3})
        got = _answer(gw, path, {**base, field: 3.0})
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] <= 3
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        key = "message" if path == CHAT else "text"
        assert got["choices"][0][key] == want["choices"][0][key]
        for bad in (2.5, True, "3", float("inf")):  # still not integers (inf: JSON's Infinity)
            status, _, raw = gw.http("POST", path, json.dumps({**base, field: bad}).encode())
            err = _error(status, raw)
            assert (status, err["code"], err["param"]) == (400, "invalid_type", field), err
        status, _, raw = gw.http("POST", path, {**base, field: 0.0})
        err = _error(status, raw)
        assert (status, err["code"], err["param"]) == (400, "invalid_value", field), err


def _events(raw: bytes) -> list:
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]"
            for e in raw.decode().split("\n\n") if e.startswith("data: ")]


def test_include_usage_null_is_absent(gw):
    """`"stream_options": {"include_usage": null}` (a client that writes unset fields as null) was
    a 400 invalid_type, where null is absent for every other field: now the stream is served,
    without the usage chunk, as with `{}`."""
    body = {"messages": MSGS, "max_tokens": 3, "stream": True}
    for opts in ({"include_usage": None}, {}):
        status, headers, raw = gw.http("POST", CHAT, {**body, "stream_options": opts})
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw
        events = _events(raw)
        assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1]), events
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length"), events
    status, _, raw = gw.http("POST", CHAT, {**body, "stream_options": {"include_usage": "yes"}})
    err = _error(status, raw)
    assert (status, err["code"], err["param"]) == (400, "invalid_type", "stream_options"), err


def test_a_template_kwarg_the_wire_cannot_carry_is_named_as_sent(gw):
    """A chat_template_kwargs value the daemon's wire cannot carry (an integer past 64 bits) was
    refused as "field 'template_args' cannot be sent", a name the request never used: the
    message now names chat_template_kwargs, as `param` did."""
    status, _, raw = gw.http("POST", CHAT, {"messages": MSGS, "max_tokens": 2,
                                            "chat_template_kwargs": {"budget": 2 ** 70}})
    err = _error(status, raw)
    assert (status, err["param"]) == (400, "chat_template_kwargs"), err
    assert "'chat_template_kwargs'" in err["message"] and "template_args'" not in err["message"].replace(
        "chat_template_kwargs'", ""), err
    assert _answer(gw, CHAT, {"messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {"budget": 2}})
