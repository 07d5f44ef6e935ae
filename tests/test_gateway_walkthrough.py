"""A new user's walk through docs/gateway.md: each test is a step where the gateway did not do what
the docs (or OpenAI's API, or HTTP) say. A real daemon with small limits, real `dflash serve`
processes, real sockets on 127.0.0.1, a tiny real model; raw HTTP and the `openai` package."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from daemon_fixtures import ROOT, Daemon, running, tiny_pair, wait_until  # noqa: F401
from test_gateway import KEY, MSGS, Gateway, _error, pair  # noqa: F401

LIMIT = 64  # the daemon's max_tokens_limit here
LIMITS = dict(max_tokens_limit=LIMIT, max_prompt_tokens=256, max_frame_bytes=65536)


@pytest.fixture(scope="module")
def daemon(pair):  # noqa: F811
    yield from running(pair, verify_window="full", **LIMITS)


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon, "--api-key", KEY, "--max-body-bytes", "262144", "--default-max-tokens", "16") as g:
        yield g


def _refused(gw: Gateway, path: str, body) -> tuple[int, str, str | None]:
    status, _, raw = gw.http("POST", path, body)
    err = _error(status, raw)
    return status, err["code"], err["param"]


def _job_state(daemon: Daemon, job_id: str) -> str:
    with daemon.client(timeout=5) as c:
        return c.status(job_id).state


# ----------------------------------------------------------------------------- limits of the daemon


def test_a_prompt_over_the_daemons_limits_names_the_prompt(gw):
    """Over max_prompt_tokens: 400 naming `messages` (chat) or `prompt`; over the daemon's frame
    cap (max_frame_bytes, below --max-body-bytes here): 413 too_large, not a 400 about 'frames'."""
    long_text = "the sea " * 400
    assert _refused(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}) == \
        (400, "bad_request", "messages")
    assert _refused(gw, "/v1/completions", {"prompt": [5] * 300}) == (400, "bad_request", "prompt")
    huge = "x " * 50_000  # 100 kB: inside the gateway's body cap, over the daemon's 64 kB frame
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        status, _, raw = gw.http("POST", path, body)
        err = _error(status, raw)
        assert (status, err["code"], err["param"]) == (413, "too_large", param), err
        assert "max_frame_bytes" in err["message"] and "shorter prompt" in err["message"]


def test_default_max_tokens_fits_the_daemons_limit(daemon):
    """A request without max_tokens gets --default-max-tokens (512 unless given). Over the daemon's
    max_tokens_limit every such request was refused: the built-in default is lowered to the limit,
    a value given over it is refused at start, and a daemon configured lower than the gateway knows
    answers naming max_tokens and the server's default."""
    env = {"DFLASH_MAX_TOKENS_LIMIT": str(LIMIT)}  # the gateway reads the daemon's configuration
    g = Gateway(daemon, env=env)
    try:
        r = g.openai(key="unused").completions.create(model="tiny-chat", prompt="Once upon a time")
        assert 1 <= r.usage.completion_tokens <= LIMIT
    finally:
        g.stop()
    out = subprocess.run([sys.executable, "-m", "dflash.engine.cli", "serve", "--attach", "--port", "0",
                          "--endpoint", daemon.endpoint, "--runtime-dir", daemon.cfg.runtime_dir,
                          "--default-max-tokens", str(LIMIT + 1)], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, **env})
    assert out.returncode == 2 and "--default-max-tokens" in out.stderr and "max_tokens_limit" in out.stderr
    unaware = Gateway(daemon, "--default-max-tokens", str(LIMIT + 1))  # its config says 8192
    try:
        status, _, raw = unaware.http("POST", "/v1/completions", {"prompt": "Once"})
        err = _error(status, raw)
        assert (status, err["param"]) == (400, "max_tokens") and "--default-max-tokens" in err["message"]
    finally:
        unaware.stop()


# ----------------------------------------------------------------------------- request fields


def test_completion_only_fields_are_refused_in_chat_too(gw):
    """docs: echo, suffix and best_of > 1 are refused (400 unsupported_parameter); a chat request
    with them was answered as if they were not there."""
    for extra, param in (({"echo": True}, "echo"), ({"suffix": "!"}, "suffix"), ({"best_of": 3}, "best_of")):
        assert _refused(gw, "/v1/chat/completions", {"messages": MSGS, **extra}) == \
            (400, "unsupported_parameter", param), extra
    status, _, _ = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "echo": False,
                                                            "best_of": 1})
    assert status == 200  # their neutral values are still accepted


def test_refusals_name_the_field_that_asked(gw):
    """`param` names the field the request sent (top_logprobs was reported as logprobs, functions
    and function_call as tools); a wrong type is invalid_type, an impossible value invalid_value,
    only a possible but unserved one unsupported_parameter (n: "2" and n: 0 were 'only n=1')."""
    chat = "/v1/chat/completions"
    cases = [({"top_logprobs": 2}, "unsupported_parameter", "top_logprobs"),
             ({"functions": [{"name": "f", "parameters": {}}]}, "unsupported_parameter", "functions"),
             ({"function_call": "auto"}, "unsupported_parameter", "function_call"),
             ({"n": "2"}, "invalid_type", "n"), ({"n": 0}, "invalid_value", "n"),
             ({"n": 2}, "unsupported_parameter", "n"),
             ({"best_of": 1.5}, "invalid_type", "best_of"),
             ({"max_tokens": "5"}, "invalid_type", "max_tokens"), ({"max_tokens": 0}, "invalid_value", "max_tokens"),
             ({"max_completion_tokens": True}, "invalid_type", "max_completion_tokens")]
    for extra, code, param in cases:
        assert _refused(gw, chat, {"messages": MSGS, **extra}) == (400, code, param), extra
    assert _refused(gw, chat, {"messages": []}) == (400, "invalid_value", "messages")


def test_fields_accepted_without_effect_still_have_types(gw):
    """user, metadata, store, service_tier, parallel_tool_calls are accepted and ignored, but a value
    of the wrong type is the 400 invalid_type OpenAI answers (it was silently taken)."""
    for extra in ({"user": 5}, {"metadata": "x"}, {"store": "yes"}, {"service_tier": 1},
                  {"parallel_tool_calls": "no"}):
        assert _refused(gw, "/v1/chat/completions", {"messages": MSGS, **extra}) == \
            (400, "invalid_type", next(iter(extra))), extra
    status, _, _ = gw.http("POST", "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False,
        "service_tier": "auto", "parallel_tool_calls": True})
    assert status == 200


def test_processor_fields_are_range_checked(gw):
    """docs: out-of-range values are a 400 invalid_value naming the field (the penalties and
    logit_bias were once accepted unapplied, then listed in x-dflash-sampling-ignored)."""
    for extra in ({"presence_penalty": 3}, {"frequency_penalty": -2.5}, {"min_p": 1.5}, {"min_p": -0.1},
                  {"repetition_penalty": 0}, {"logit_bias": {"5": -101}}, {"logit_bias": {"-5": 1}}):
        assert _refused(gw, "/v1/chat/completions", {"messages": MSGS, **extra}) == \
            (400, "invalid_value", next(iter(extra))), extra
    assert _refused(gw, "/v1/chat/completions", {"messages": MSGS, "logit_bias": {"5": "up"}}) == \
        (400, "invalid_type", "logit_bias")
    status, headers, _ = gw.http("POST", "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 2, "presence_penalty": 2, "min_p": 0.05, "logit_bias": {"5": -1.5}})
    assert status == 200 and "x-dflash-sampling-ignored" not in headers  # all applied


def test_a_body_that_does_not_decompress_is_a_400(gw):
    """docs: a 500 is never something a request body says. A `Content-Encoding: gzip` body that is
    not gzip was a 500 'internal gateway error: RequestPayloadError'."""
    ok = gzip.compress(json.dumps({"prompt": "Once", "max_tokens": 2}).encode())
    status, _, _ = gw.http("POST", "/v1/completions", ok, headers={"Content-Encoding": "gzip"})
    assert status == 200
    status, _, raw = gw.http("POST", "/v1/completions", b"not gzip at all", headers={"Content-Encoding": "gzip"})
    err = _error(status, raw)
    assert (status, err["code"], err["param"]) == (400, "invalid_body", None) and "gzip" in err["message"]


def test_wrong_method_says_which_are_allowed(gw):
    """A 405 must carry Allow (RFC 9110); the OpenAI-shaped body replaced aiohttp's and lost it."""
    for path, allowed in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST")):
        status, headers, raw = gw.http("GET", path)
        assert status == 405 and headers.get("allow") == allowed and _error(status, raw)
    status, headers, _ = gw.http("DELETE", "/v1/models")
    assert status == 405 and set(headers["allow"].split(",")) >= {"GET", "HEAD"}


def test_prometheus_samples_are_exact(gw):
    """/metrics printed samples with 6 significant digits (`:g`): a counter past 999999 read
    1.23457e+06 and stood still between scrapes. The text now says what the JSON says."""
    gw.openai().chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=8)
    _, _, text = gw.http("GET", "/metrics")
    _, _, js = gw.http("GET", "/metrics?format=json")
    want = json.loads(js)["gateway"]
    prom = dict(ln.rsplit(" ", 1) for ln in text.decode().splitlines() if ln and not ln.startswith("#"))
    for name, key in (("decode_tokens_per_second", "decode_tokens_per_second"),
                      ("tokens_per_cycle", "tokens_per_cycle"), ("mean_ttft_seconds", "mean_ttft_s"),
                      ("completion_tokens_total", "completion_tokens")):
        assert float(prom[f"dflash_gateway_{name}"]) == want[key], name
    from dflash.daemon.gateway_metrics import sample_value

    exact = (sample_value(1234567), sample_value(98765432.5), sample_value(float("inf")))
    assert exact == ("1234567", "98765432.5", "+Inf")


# ----------------------------------------------------------------------------- stopping the server


def _chat(port: int, body: dict) -> http.client.HTTPConnection:
    """A chat request sent, its answer not yet read (conn.getresponse())."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def _running_job(daemon: Daemon) -> str:
    with daemon.client(timeout=5) as c:
        wait_until(lambda: any(j["state"] == "running" for j in c.jobs()), 20, "the job to run")
        return next(j["job_id"] for j in c.jobs() if j["state"] == "running")


def test_stopping_the_gateway_ends_requests_in_flight(pair):  # noqa: F811
    """SIGTERM/Ctrl-C with a generation in flight: `serve` kept streaming it for a minute or more
    (aiohttp's 60 s grace, twice), then cut the connection without a word. Now it exits within
    seconds; a stream ends with a shutting_down error event and [DONE], a waiting request gets a
    503 shutting_down, and their jobs are cancelled in the daemon."""
    slow = Daemon(*pair, verify_window=1)  # plain steps: 4000 tokens take a while
    try:
        slow.start()
        for stream in (True, False):
            g = Gateway(slow)
            try:
                conn = _chat(g.port, {"messages": MSGS, "max_tokens": 4000, "stream": stream})
                if stream:
                    r = conn.getresponse()
                    assert r.readline().startswith(b"data: ")  # it streams
                job_id = _running_job(slow)
                t0 = time.monotonic()
                g.proc.send_signal(signal.SIGTERM)
                if not stream:
                    r = conn.getresponse()
                rest = r.read().decode()
                assert g.proc.wait(15) == 0 and time.monotonic() - t0 < 10
                if stream:
                    events = [e for e in rest.split("\n\n") if e.startswith("data: ")]
                    assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
                    assert events[-1] == "data: [DONE]"
                else:
                    assert r.status == 503 and json.loads(rest)["error"]["code"] == "shutting_down"
                wait_until(lambda: _job_state(slow, job_id) == "cancelled", 10, "the job to be cancelled")
                conn.close()
            finally:
                g.stop()
    finally:
        slow.stop()
