"""Session 51's walk through docs/gateway.md with a real model: each test is a step where the
gateway did not do what the docs say. A real daemon (tiny real pair), a real `dflash serve`
process, raw HTTP on 127.0.0.1."""

from __future__ import annotations

import json

import pytest
from daemon_fixtures import running, tiny_pair  # noqa: F401
from test_gateway import KEY, MSGS, Gateway, _error, pair  # noqa: F401

LIMIT = 64  # the daemon's max_tokens_limit here


@pytest.fixture(scope="module")
def daemon(pair):  # noqa: F811
    yield from running(pair, verify_window="full", max_tokens_limit=LIMIT)


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon, "--api-key", KEY, "--default-max-tokens", "16") as g:
        yield g


def test_max_completion_tokens_over_the_limit_is_named_as_sent(gw):
    """A chat that set max_completion_tokens past the daemon's limit (beside a max_tokens that was
    fine) read "max_tokens must be in 1..64, got 1000": a field it set to 5. The message names
    the field as `param` does."""
    body = {"messages": MSGS, "max_tokens": 5, "max_completion_tokens": 1000}
    status, _, raw = gw.http("POST", "/v1/chat/completions", body)
    err = _error(status, raw)
    assert (status, err["code"], err["param"]) == (400, "bad_request", "max_completion_tokens")
    assert err["message"].startswith(f"max_completion_tokens must be in 1..{LIMIT}, got 1000"), err["message"]
    assert "max_tokens" not in err["message"].replace("max_completion_tokens", ""), err["message"]
    # max_tokens alone keeps its own name
    status, _, raw = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1000})
    err = _error(status, raw)
    assert err["param"] == "max_tokens" and err["message"].startswith("max_tokens must be in"), err


def test_models_say_the_loaded_dtype(gw, pair):  # noqa: F811
    """/v1/models' `dflash` map has a dtype (docs/gateway.md); with no --dtype it was null, though
    the weights are in one. Now it is the loaded target's, the same `dflashd start` would name."""
    from dflash.engine.loading import load_pair, main_dtype

    status, _, raw = gw.http("GET", "/v1/models")
    assert status == 200
    row = json.loads(raw)["data"][0]["dflash"]
    assert row["dtype"] == main_dtype(load_pair(*pair).target.model) and row["dtype"], row


def test_a_cancel_during_a_long_prefill_stops_it(daemon):
    """A job is cancelled (a client's disconnect, `cancel`, its timeout) between prefill chunks
    too, not only between decode cycles: a 4,000-token prompt of SmolLM2 took 70 s on a 2-core
    CPU, and its disconnected HTTP client's job ran on for all of it. A job already past its
    timeout_s when it starts now ends in its prefill with no token (it made the first one)."""
    with daemon.client(timeout=30) as c:
        r = c.generate([5] * 1000, max_tokens=8, timeout_s=1e-6)
    assert r.finish_reason == "timeout" and r.token_ids == [] and r.text == "", (r.finish_reason, r.token_ids)
    assert r.stats["ttft_s"] == 0 and r.stats["total_s"] > 0, r.stats  # no first token: no TTFT
    with daemon.client(timeout=30) as c:  # and the worker serves on
        assert c.generate([5] * 1000, max_tokens=4).finish_reason in ("stop", "length")


def test_the_seed_reported_is_drawn_only_for_a_sampled_answer(gw):
    """docs/gateway.md said an absent seed "gets a random one"; a greedy answer draws none and
    reports null (the docs now say so). Pins the documented behaviour: a doc fix, no code change."""
    def seed(**extra) -> object:
        status, _, raw = gw.http("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **extra})
        assert status == 200, raw
        return json.loads(raw)["dflash"]["sampling"]["seed"]

    assert seed() is None and seed(seed=5) == 5
    drawn = seed(temperature=0.8)
    assert isinstance(drawn, int) and 0 <= drawn < 2**64


def test_a_stop_string_over_256_characters_is_refused_as_documented(gw):
    """docs/gateway.md said only "up to 16 strings"; one of 257 characters is a 400 naming `stop`
    too (the daemon's rule, docs/protocol.md). Pins the documented limit: a doc fix."""
    for stop in ("a" * 257, ["b", "a" * 257]):
        status, _, raw = gw.http("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stop": stop})
        err = _error(status, raw)
        assert (status, err["code"], err["param"]) == (400, "invalid_value", "stop"), err
    status, _, raw = gw.http("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stop": "a" * 256})
    assert status == 200, raw


def test_a_job_with_no_token_is_not_in_the_mean_ttft():
    """A job cancelled during its prefill made no first token: its time was counted as one in
    the gateway's mean TTFT (and its 0 now would pull the mean down). Only jobs with a token count."""
    from dflash.daemon.gateway_metrics import GatewayMetrics

    m = GatewayMetrics()
    m.job({"generated_tokens": 8, "ttft_s": 0.2, "decode_tps": 20.0}, "length")
    m.job({"generated_tokens": 0, "ttft_s": 0.0, "total_s": 70.0}, "cancelled")
    m.job({"generated_tokens": 4, "ttft_s": 0.4, "decode_tps": 20.0}, "stop")
    s = m.summary()
    assert s["jobs"] == 3 and abs(s["mean_ttft_s"] - 0.3) < 1e-12, s
