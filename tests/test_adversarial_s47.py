"""Adversarial hunt on the HTTP gateway, session 47: each test is a defect found by probing a real
`dflash serve --attach` process on a real daemon (tiny model) as a hostile or demanding client
would, and fails on the code before its fix. Real processes, sockets and models; no mocks."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading

import pytest
from daemon_fixtures import Daemon, running, tiny_pair, wait_until  # noqa: F401
from test_gateway import Gateway

from dflash.engine.loading import load_pair

LONG = 8000  # tokens: tens of seconds of the tiny model, so the job is still running when it is cut


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon) as g:
        yield g


@pytest.fixture(scope="module")
def no_eos(tiny_pair) -> dict:  # noqa: F811
    """A logit_bias that bans the end of text, so a long job can only end by being cut."""
    tok = load_pair(*tiny_pair).tokenizer
    return {str(tok.eos_token_id): -100}


def _post(port: int, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


@pytest.mark.parametrize("field, where", [("max_tokens", b'"max_tokens": %s'), ("seed", b'"seed": -%s'),
                                          ("top_k", b'"top_k": %s'), ("prompt", b'"max_tokens": 2, "prompt": [1, %s]')])
def test_an_integer_past_pythons_digit_limit_is_invalid_value_naming_its_field(gw, field, where):
    """JSON allows integers of any size, and docs/gateway.md answers one too large with a 400
    invalid_value naming its field. Past 4300 digits Python's json refused to read it at all: a
    400 invalid_json about the whole body (param null) whose message told the HTTP client to "use
    sys.set_int_max_str_digits() to increase the limit"."""
    huge = b"7" * 5000
    body = b"{" + (where % huge) + (b"" if field == "prompt" else b', "prompt": "hi"') + b"}"
    status, _, raw = _post(gw.port, "/v1/completions", body)
    err = _error(raw)
    assert status == 400 and err["code"] == "invalid_value" and err["param"] == field, err
    assert "sys." not in err["message"] and "about 5000 digits" in err["message"], err
    assert len(err["message"]) < 300, err  # the value is not echoed whole


def test_a_worker_gone_answer_names_the_job_the_daemon_kept(gw, daemon, no_eos):
    """The worker dies under a request whose answer has not begun (a whole answer, and a stream
    still queued): docs/gateway.md says the job that died is held by the daemon and named by the
    response's x-dflash-job-id, for `dflash-client result <id>`. The 503 worker_gone had no such
    header (only a stream whose headers had gone out carried it), so those kept jobs could not be
    found by the HTTP client that sent them."""
    got: dict[str, tuple] = {}

    def ask(name: str, stream: bool) -> None:
        got[name] = _post(gw.port, "/v1/completions", {"prompt": f"{name}: a story", "max_tokens": LONG,
                                                        "stream": stream, "logit_bias": no_eos})

    whole = threading.Thread(target=ask, args=("whole", False))
    whole.start()
    with daemon.client(timeout=10) as c:
        wait_until(lambda: any(r["state"] == "running" for r in c.jobs()), what="the first job to run")
        queued = threading.Thread(target=ask, args=("queued", True))
        queued.start()
        wait_until(lambda: any(r["state"] == "queued" for r in c.jobs()), what="the stream's job to be queued")
        os.kill(c.stats()["pid"], signal.SIGKILL)
    whole.join(30)
    queued.join(30)
    daemon.wait_ready()
    try:
        with daemon.client(timeout=10) as c:
            kept = {r["job_id"]: r["state"] for r in c.jobs()}
        for name in ("whole", "queued"):
            status, headers, raw = got[name]
            assert status == 503 and _error(raw)["code"] == "worker_gone", (name, status, raw)
            job_id = headers.get("x-dflash-job-id")
            assert job_id and kept.get(job_id) == "held", (name, headers, kept)
    finally:
        with daemon.client(timeout=10) as c:
            for r in c.jobs():
                c.cancel(r["job_id"])
    # and only such jobs: a submit the daemon refused queued nothing, so its answer names none
    status, headers, raw = _post(gw.port, "/v1/completions", {"prompt": "hi", "max_tokens": 10**9})
    assert status == 400 and _error(raw)["param"] == "max_tokens", raw
    assert "x-dflash-job-id" not in headers, headers



def test_an_attached_gateway_lowers_its_default_max_tokens_to_the_daemons_limit(tiny_pair):  # noqa: F811
    """docs/gateway.md: the built-in --default-max-tokens (512) is lowered to the daemon's
    max_tokens_limit when that is lower. `dflash serve --attach` took the limit from its own
    configuration, not the daemon's: attached to a daemon configured lower (another config file,
    DFLASH_MAX_TOKENS_LIMIT in the daemon's shell), every request without max_tokens (the openai
    client's default) was a 400 naming max_tokens."""
    d = Daemon(*tiny_pair, max_tokens_limit=8)
    try:
        d.start()
        with Gateway(d) as g:  # its configuration says 8192
            status, _, raw = _post(g.port, "/v1/completions", {"prompt": "Once upon a time"})
            assert status == 200, raw
            assert 1 <= json.loads(raw)["usage"]["completion_tokens"] <= 8, raw
    finally:
        d.stop()


def test_a_401_says_which_authentication_scheme(daemon):
    """RFC 9110 (15.5.2): a server generating a 401 MUST send WWW-Authenticate. A gateway with an
    API key answered a missing or wrong key with none, so a generic HTTP client could not tell it
    wants a bearer token; the JSON body is unchanged."""
    with Gateway(daemon, "--api-key", "sk-s47") as g:
        for key in (None, "wrong"):
            status, headers, raw = g.http("GET", "/v1/models", key=key)
            assert status == 401 and _error(raw)["code"] == "invalid_api_key", raw
            assert headers.get("www-authenticate") == "Bearer", headers
        assert g.http("GET", "/v1/models", key="sk-s47")[0] == 200
