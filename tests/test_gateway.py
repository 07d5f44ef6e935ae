"""`dflash serve`, the OpenAI-compatible gateway: a real daemon, real gateway processes, real
sockets on 127.0.0.1, tiny real models; driven by the official `openai` package and raw HTTP."""

from __future__ import annotations

import http.client
import json
import os
import select
from pathlib import Path
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from click.testing import CliRunner
from daemon_fixtures import _REF_PAIR, ROOT, Daemon, reference, tiny_pair  # noqa: F401

from dflash.engine import tiny

KEY = "sk-test-gateway"
MSGS = [{"role": "user", "content": "Tell me about the sea."}]
# The tiny template, plus a switch a real model's template has (Qwen3's enable_thinking).
THINK_TEMPLATE = tiny.CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def pair(tiny_pair, tmp_path_factory) -> tuple[str, str]:  # noqa: F811
    """A copy of the tiny pair whose chat template honours enable_thinking."""
    d = tmp_path_factory.mktemp("gwpair") / "tiny-chat"
    shutil.copytree(tiny_pair[0], d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = THINK_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(d), str(d / "draft")


@pytest.fixture(scope="module")
def daemon(pair):
    d = Daemon(*pair, verify_window="full")  # fixed: a seed repeats its ids (greedy is the same under any)
    try:
        yield d.start()
    finally:
        d.stop()


class Gateway:
    """A `dflash serve --attach` process; `url` once it prints that it listens."""

    def __init__(self, daemon: Daemon, *args: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "dflash.engine.cli", "serve", "--attach", "--port", "0",
               "--endpoint", daemon.endpoint, "--runtime-dir", daemon.cfg.runtime_dir,
               "--state-dir", daemon.cfg.state_dir, *args]
        self.err = open(daemon.dir / f"gateway-{time.monotonic_ns()}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, cwd=ROOT,
                                     env={**os.environ, **(env or {})})
        end, line = time.monotonic() + 30, b""
        while time.monotonic() < end and b"listening on" not in line:
            assert self.proc.poll() is None, f"gateway exited {self.proc.returncode}"
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline()
        assert b"listening on" in line, "gateway did not start in 30s"
        self.url = line.split(b"listening on ")[1].split()[0].decode()
        self.port = int(self.url.rsplit(":", 1)[1])

    def openai(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def http(self, method: str, path: str, body=None, headers: dict | None = None,
             key: str | None = KEY) -> tuple[int, dict, bytes]:
        """One raw HTTP request: status, lower-cased headers, body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        try:
            conn.request(method, path, body=data, headers=h)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def __enter__(self) -> "Gateway":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.err.close()


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon, "--api-key", KEY, "--max-body-bytes", "65536", "--default-max-tokens", "16") as g:
        yield g


@pytest.fixture(scope="module")
def tok(pair):
    from dflash.engine.loading import load_pair

    if pair not in _REF_PAIR:
        _REF_PAIR[pair] = load_pair(*pair)
    return _REF_PAIR[pair].tokenizer


def _error(status: int, body: bytes) -> dict:
    """The OpenAI error object, checked for its exact shape."""
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


# ----------------------------------------------------------------------------- openai client


def test_chat_non_stream_is_lossless_with_usage(gw, pair, tok):
    from dflash.engine.prompting import build_prompt

    raw = gw.openai().chat.completions.with_raw_response.create(model="tiny-chat", messages=MSGS, max_tokens=16)
    r = raw.parse()
    text, ids = reference(pair, MSGS, 16)
    assert r.object == "chat.completion" and r.model == "tiny-chat" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason in ("stop", "length")
    prompt_len = len(build_prompt(tok, MSGS))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, len(ids))
    assert r.usage.total_tokens == prompt_len + len(ids)
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)
    assert "x-dflash-sampling-ignored" not in raw.headers  # nothing asked for goes unapplied
    assert r.id == "chatcmpl-" + raw.headers["x-dflash-job-id"]
    assert r.model_extra["dflash"]["sampling"]["temperature"] == 0.0  # absent: the daemon's default, greedy


def test_chat_stream_with_usage(gw):
    c = gw.openai()
    whole = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_completion_tokens=12)
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=MSGS, max_completion_tokens=12,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(ch.usage is None for ch in chunks[:-1]) and len({ch.id for ch in chunks}) == 1
    plain = list(c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=4, stream=True))
    assert all(ch.usage is None for ch in plain)  # usage only when asked for


def test_completions_raw_prompt_text_and_ids(gw, pair, tok):
    c = gw.openai()
    prompt = "Once upon a time there was a"
    ids = list(tok.encode(prompt))
    text, out_ids = reference(pair, ids, 10)  # /v1/completions: no chat template
    by_text = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10)
    by_ids = c.completions.create(model="tiny-chat", prompt=ids, max_tokens=10)
    for r in (by_text, by_ids):
        assert r.object == "text_completion" and r.choices[0].text == text
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(out_ids))
    chunks = list(c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == len(out_ids)


def test_stop_default_max_tokens_and_raw_sse(gw, pair):
    text, _ = reference(pair, MSGS, 16)
    stop = text[3:6]
    want, _ = reference(pair, MSGS, 16, stop=[stop])
    r = gw.openai().chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=16, stop=stop)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop" and stop not in want
    d = gw.openai().chat.completions.create(model="tiny-chat", messages=MSGS)  # --default-max-tokens 16
    assert d.usage.completion_tokens == 16 and d.choices[0].message.content == text
    status, headers, body = gw.http("POST", "/v1/completions", {"prompt": "Tell me", "max_tokens": 3, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_chat_template_kwargs_reach_the_template(gw, tok):
    from dflash.engine.prompting import build_prompt

    c = gw.openai()
    plain = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=2)
    # mlx-lm passes enable_thinking=False when a tokenizer has no think tokens (this one), so
    # the template's empty think block is there by default, and True (sent through) removes it.
    on = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=2,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    want = len(build_prompt(tok, MSGS, template_args={"enable_thinking": True}))
    assert on.usage.prompt_tokens == want < plain.usage.prompt_tokens == len(build_prompt(tok, MSGS))
    status, _, body = gw.http("POST", "/v1/chat/completions",
                              {"messages": MSGS, "chat_template_kwargs": {"tokenize": False}})
    assert status == 400 and _error(status, body)["param"] == "chat_template_kwargs"


SAMPLED = dict(temperature=0.9, top_p=0.95, seed=7)  # + top_k 40, an extra field (vLLM's)
APPLIED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7, "min_p": 0.0, "min_tokens_to_keep": 1}


def test_sampling_is_applied(gw, pair, tok):
    c = gw.openai()
    want, want_ids = reference(pair, MSGS, 16, **APPLIED, verify_window="full")
    greedy, _ = reference(pair, MSGS, 16)
    assert want != greedy
    raw = c.chat.completions.with_raw_response.create(model="tiny-chat", messages=MSGS, max_tokens=16, **SAMPLED,
                                                      extra_body={"top_k": 40})
    r = raw.parse()
    assert r.choices[0].message.content == want and r.usage.completion_tokens == len(want_ids)
    assert "x-dflash-sampling-ignored" not in raw.headers and r.model_extra["dflash"]["sampling"] == APPLIED
    again = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=16, **SAMPLED, extra_body={"top_k": 40})
    assert again.choices[0].message.content == want  # same seed, same text
    chunks = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=16, stream=True, **SAMPLED,
                                       extra_body={"top_k": 40})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    other = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=16, **{**SAMPLED, "seed": 8},
                                      extra_body={"top_k": 40})
    assert other.choices[0].message.content == reference(pair, MSGS, 16, **{**APPLIED, "seed": 8}, verify_window="full")[0]
    ids = list(tok.encode("Once upon a time"))  # /v1/completions too; top_k -1 is vLLM's "off" (0)
    text = reference(pair, ids, 10, temperature=0.7, top_k=0, seed=3, verify_window="full")[0]
    done = c.completions.create(model="tiny-chat", prompt=ids, max_tokens=10, temperature=0.7, seed=3,
                                extra_body={"top_k": -1})
    assert done.choices[0].text == text and done.model_extra["dflash"]["sampling"]["top_k"] == 0
    # min_p (vLLM's extra field) is applied as mlx-lm's make_sampler(min_p=...) applies it
    text = reference(pair, ids, 10, temperature=1.5, min_p=0.2, seed=3, verify_window="full")[0]
    assert text != reference(pair, ids, 10, temperature=1.5, seed=3, verify_window="full")[0]
    raw = c.completions.with_raw_response.create(model="tiny-chat", prompt=ids, max_tokens=10, temperature=1.5,
                                                 seed=3, extra_body={"min_p": 0.2})
    done = raw.parse()
    assert done.choices[0].text == text and done.model_extra["dflash"]["sampling"]["min_p"] == 0.2
    assert "x-dflash-sampling-ignored" not in raw.headers


def test_min_tokens_to_keep_is_applied(gw, pair, tok):
    """min_tokens_to_keep (an extra field: mlx-lm's make_sampler argument) reaches the engine from
    both endpoints: min-p 1 keeps only the most likely token of the near-uniform tiny model (so
    alone it is greedy), and min_tokens_to_keep 5 samples among the 5 most likely, as in-process."""
    c = gw.openai()
    ids = list(tok.encode("Once upon a time"))
    keep = dict(temperature=1.5, min_p=1.0, min_tokens_to_keep=5, seed=3)
    text = reference(pair, ids, 10, **keep, verify_window="full")[0]
    assert text != reference(pair, ids, 10, **{**keep, "min_tokens_to_keep": 1}, verify_window="full")[0]
    raw = c.completions.with_raw_response.create(model="tiny-chat", prompt=ids, max_tokens=10, temperature=1.5,
                                                 seed=3, extra_body={"min_p": 1.0, "min_tokens_to_keep": 5.0})
    done = raw.parse()  # an integral float is an integer, as for top_k and seed
    assert done.choices[0].text == text and "x-dflash-sampling-ignored" not in raw.headers
    assert done.model_extra["dflash"]["sampling"] == {"temperature": 1.5, "top_p": 1.0, "top_k": 0, "seed": 3,
                                                      "min_p": 1.0, "min_tokens_to_keep": 5}
    want = reference(pair, MSGS, 8, **keep, verify_window="full")[0]
    r = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=8, temperature=1.5, seed=3,
                                  extra_body={"min_p": 1.0, "min_tokens_to_keep": 5})
    assert r.choices[0].message.content == want


def test_penalties_and_logit_bias_are_applied(gw, pair):
    """OpenAI's logit_bias / presence_penalty / frequency_penalty, vLLM's repetition_penalty and
    mlx-lm server's context sizes reach the engine: greedy and sampled answers equal the
    in-process engine's with them, and nothing is listed as ignored."""
    c = gw.openai()
    procs = dict(presence_penalty=1.5, frequency_penalty=0, logit_bias={"5": 8})
    extra = {"repetition_penalty": 1.6, "repetition_context_size": 30}
    greedy = reference(pair, MSGS, 12)[0]
    want = reference(pair, MSGS, 12, **procs, **extra)[0]
    assert want != greedy
    raw = c.chat.completions.with_raw_response.create(model="tiny-chat", messages=MSGS, max_tokens=12, **procs,
                                                      extra_body=extra)
    assert raw.parse().choices[0].message.content == want
    assert "x-dflash-sampling-ignored" not in raw.headers
    sampling = raw.parse().model_extra["dflash"]["sampling"]
    assert sampling["presence_penalty"] == 1.5 and sampling["logit_bias"] == {"5": 8.0}
    assert "frequency_penalty" not in sampling  # 0: off
    sampled = reference(pair, MSGS, 8, **APPLIED, **procs, **extra, verify_window="full")[0]
    r = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=8, **SAMPLED, **procs,
                                  extra_body={"top_k": 40, **extra})
    assert r.choices[0].message.content == sampled
    for body, code, param in [({"logit_bias": {"x": 1}}, "invalid_value", "logit_bias"),
                              ({"logit_bias": {"5": 101}}, "invalid_value", "logit_bias"),
                              ({"logit_bias": {"99999999": 1}}, "bad_sampling", "logit_bias"),  # past the vocabulary
                              ({"repetition_context_size": 0}, "invalid_value", "repetition_context_size"),
                              ({"presence_context_size": "5"}, "invalid_type", "presence_context_size")]:
        status, _, out = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **body})
        err = _error(status, out)
        assert (status, err["code"], err["param"]) == (400, code, param), (body, err)


def test_bad_sampling_values_in_openai_shape(gw):
    cases = [({"temperature": -1}, "invalid_value", "temperature"), ({"temperature": "hot"}, "invalid_type", "temperature"),
             ({"top_p": 0}, "invalid_value", "top_p"), ({"top_p": 1.5}, "invalid_value", "top_p"),
             ({"top_k": -2}, "invalid_value", "top_k"), ({"top_k": 2.5}, "invalid_type", "top_k"),
             ({"seed": -3}, "invalid_value", "seed"), ({"seed": "7"}, "invalid_type", "seed"),
             ({"min_p": -0.1}, "invalid_value", "min_p"), ({"min_p": 1.5}, "invalid_value", "min_p"),
             ({"min_p": "0.1"}, "invalid_type", "min_p"),
             ({"min_tokens_to_keep": 0}, "invalid_value", "min_tokens_to_keep"),
             ({"min_tokens_to_keep": -4}, "invalid_value", "min_tokens_to_keep"),
             ({"min_tokens_to_keep": 1 << 64}, "invalid_value", "min_tokens_to_keep"),
             ({"min_tokens_to_keep": 2.5}, "invalid_type", "min_tokens_to_keep"),
             ({"min_tokens_to_keep": "3"}, "invalid_type", "min_tokens_to_keep"),
             ({"min_tokens_to_keep": True}, "invalid_type", "min_tokens_to_keep")]
    for extra, code, param in cases:
        status, _, body = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **extra})
        err = _error(status, body)
        assert (status, err["code"], err["param"]) == (400, code, param), (extra, err)
        if param == "min_tokens_to_keep":  # a clear message: the field and what it must be
            assert "min_tokens_to_keep" in err["message"] and "must be an integer" in err["message"], err
    status, _, _ = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "top_k": -1,
                                                            "temperature": None, "seed": 7.0})
    assert status == 200  # -1: off; null: absent; an integral float seed is an integer


def test_a_request_sets_its_verify_window(gw, pair):
    """dflash's extra field: verify_window reaches the job (1 = plain decoding: no draft cycle),
    the answer is the same greedy text, and the `dflash` object says what ran."""
    c = gw.openai()
    text, ids = reference(pair, MSGS, 12)
    for window, plain in ((1, True), (4, False), ("full", False)):
        r = c.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=12,
                                      extra_body={"verify_window": window})
        facts = r.model_extra["dflash"]
        assert r.choices[0].message.content == text and facts["verify_window"] == window
        assert (facts["accepted_drafts"] == 0 and facts["tokens_per_cycle"] == 1.0) if plain else True
    for bad in (0, "8", 2.5, True):
        status, _, body = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2,
                                                                   "verify_window": bad})
        err = _error(status, body)
        assert (status, err["code"], err["param"]) == (400, "invalid_value", "verify_window"), (bad, err)
    status, _, body = gw.http("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2,
                                                               "verify_window": 99})
    assert status == 400 and "block of 16 tokens" in _error(status, body)["message"]


def test_sampling_policies_and_server_defaults(daemon, pair):
    want = reference(pair, MSGS, 8, temperature=0.8, top_p=1.0, top_k=20, seed=5, verify_window="full")[0]
    greedy = reference(pair, MSGS, 8)[0]
    strict = Gateway(daemon, "--sampling", "reject", "--default-temperature", "0.8", "--default-top-k", "20",
                     "--default-min-tokens-to-keep", "3")
    try:
        s = strict.openai(key="unused")  # no --api-key: no auth
        r = s.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=8, seed=5)  # no temperature
        assert r.choices[0].message.content == want  # min_tokens_to_keep changes nothing without min-p
        assert r.model_extra["dflash"]["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 20, "seed": 5,
                                                       "min_p": 0.0, "min_tokens_to_keep": 3}
        kept = s.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=8, seed=5, extra_body={"min_p": 1.0})
        assert kept.choices[0].message.content == reference(pair, MSGS, 8, temperature=0.8, top_k=20, seed=5, min_p=1.0,
                                                            min_tokens_to_keep=3, verify_window="full")[0]
        ok = s.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=8, temperature=0)
        assert ok.choices[0].message.content == greedy  # the request's own value wins
        # every field is applied now, so `reject` refuses none of them
        r = s.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=4, frequency_penalty=0.3)
        assert r.model_extra["dflash"]["sampling"]["frequency_penalty"] == 0.3
    finally:
        strict.stop()
    forced = Gateway(daemon, "--sampling", "greedy")
    try:
        raw = forced.openai(key="unused").chat.completions.with_raw_response.create(
            model="tiny-chat", messages=MSGS, max_tokens=8, **SAMPLED, presence_penalty=1.0,
            extra_body={"min_p": 0.1, "min_tokens_to_keep": 3})
        # greedy, the processors still applied (they are deterministic)
        assert raw.parse().choices[0].message.content == reference(pair, MSGS, 8, presence_penalty=1.0)[0]
        assert raw.headers["x-dflash-sampling-ignored"] == "temperature,top_p,min_p,min_tokens_to_keep"
    finally:
        forced.stop()


def test_models_health_metrics(gw):
    models = gw.openai().models.list()
    assert [m.id for m in models.data] == ["tiny-chat"] and models.data[0].owned_by == "dflash"
    status, _, body = gw.http("GET", "/health", key=None)  # health needs no key
    assert status == 200 and json.loads(body)["worker"] == "ready"
    gw.openai().chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=4)
    status, headers, body = gw.http("GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("dflash_gateway_acceptance_ratio", "dflash_gateway_decode_tokens_per_second",
                 "dflash_gateway_tokens_per_cycle", "dflash_daemon_jobs_done", "dflash_daemon_up 1"):
        assert name in text, name
    assert 'dflash_http_requests_total{route="/v1/chat/completions",status="200"}' in text
    status, _, body = gw.http("GET", "/metrics?format=json")
    m = json.loads(body)
    assert m["gateway"]["jobs"] >= 1 and m["gateway"]["completion_tokens"] >= 4
    assert m["gateway"]["decode_tokens_per_second"] > 0 and 0 <= m["gateway"]["acceptance"] <= 1
    assert m["daemon"]["state"] == "ready"


# ----------------------------------------------------------------------------- raw HTTP errors


def test_errors_in_openai_shape(gw):
    cases = [
        ("POST", "/v1/chat/completions", b"{not json", 400, "invalid_json", None),
        ("POST", "/v1/chat/completions", [1, 2], 400, "invalid_type", None),
        ("POST", "/v1/chat/completions", {"model": "tiny-chat"}, 400, "missing_required_parameter", "messages"),
        ("POST", "/v1/chat/completions", {"messages": MSGS, "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
        ("POST", "/v1/chat/completions", {"messages": MSGS, "n": 2}, 400, "unsupported_parameter", "n"),
        ("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
         "unsupported_parameter", "messages[0]"),
        ("POST", "/v1/chat/completions", {"model": "gpt-9", "messages": MSGS}, 404, "model_not_found", "model"),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "bad_request",
         "max_tokens"),  # over the daemon's max_tokens_limit: named like any other parameter
        ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
        ("POST", "/v1/completions", {"prompt": "  "}, 400, "invalid_value", "prompt"),
        ("GET", "/v1/chat/completions", None, 405, None, None),
        ("GET", "/v2/nothing", None, 404, None, None),
    ]
    for method, path, body, want_status, want_code, want_param in cases:
        status, headers, raw = gw.http(method, path, body)
        err = _error(status, raw)
        assert (status, err["code"], err["param"]) == (want_status, want_code, want_param), (path, body, err)
        assert headers["content-type"].startswith("application/json")


def test_daemon_refusals_name_their_param(gw):
    """What only the daemon can check (its max_tokens_limit, the vocabulary, the draft's block) and
    what its wire cannot carry (integers past 64 bits) is a 400 whose `param` names the field as the
    request spelt it, like every other parameter error; it was null."""
    cases = [
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 10**6}, "bad_request", "max_tokens"),
        ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 10**6}, "bad_request",
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": [10**6], "max_tokens": 2}, "bad_request", "prompt"),  # outside the vocabulary
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "verify_window": 99}, "bad_request",
         "verify_window"),  # over the draft's block
        ("/v1/completions", {"prompt": [-1], "max_tokens": 2}, "invalid_value", "prompt"),
        ("/v1/completions", {"prompt": [2**70], "max_tokens": 2}, "invalid_value", "prompt"),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2**70}, "invalid_value", "max_tokens"),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "top_k": 2**70}, "invalid_value", "top_k"),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "top_k": 1e30}, "invalid_value", "top_k"),
    ]
    for path, body, code, param in cases:
        status, _, raw = gw.http("POST", path, body)
        err = _error(status, raw)
        assert (status, err["code"], err["param"]) == (400, code, param), (body, err)
    with pytest.raises(openai.BadRequestError) as e:
        gw.openai().completions.create(model="tiny-chat", prompt="x", max_tokens=10**6)
    assert e.value.param == "max_tokens" and "max_tokens must be in 1..8192" in e.value.message


def test_api_key_and_body_cap(gw):
    for key in (None, "sk-wrong"):
        status, _, body = gw.http("POST", "/v1/chat/completions", {"messages": MSGS}, key=key)
        assert status == 401 and _error(status, body)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        gw.openai(key="sk-wrong").models.list()
    big = {"messages": [{"role": "user", "content": "x" * 70_000}]}  # over --max-body-bytes 65536
    status, _, body = gw.http("POST", "/v1/chat/completions", big)
    assert status == 413 and _error(status, body)["code"] == "body_too_large"
    # No Content-Length (chunked): the cap holds while reading.
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=iter([json.dumps(big).encode()]),
                     headers={"Authorization": f"Bearer {KEY}"})  # an iterator body goes chunked
        r = conn.getresponse()
        assert r.status == 413 and _error(r.status, r.read())["code"] == "body_too_large"
    finally:
        conn.close()
    status, _, _ = gw.http("GET", "/health", key=None)
    assert status == 200  # the gateway goes on


# ----------------------------------------------------------------------------- disconnects, concurrency


def _raw_post(port: int, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _wait_state(daemon: Daemon, job_id: str, state: str, timeout: float = 15.0) -> None:
    with daemon.client(timeout=5) as c:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if c.status(job_id).state == state:
                return
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} is {c.status(job_id).state}, not {state}")


def test_disconnect_mid_stream_cancels_the_job(gw, daemon):
    with daemon.client(timeout=5) as c:
        before = c.stats()["jobs_cancelled"]
    s = _raw_post(gw.port, {"messages": MSGS, "max_tokens": 4000, "stream": True})
    buf = b""
    end = time.monotonic() + 20
    while b"\r\n\r\n" not in buf or buf.count(b"data: ") < 3:  # headers and a few chunks
        assert time.monotonic() < end, buf
        buf += s.recv(65536)
    head = buf.split(b"\r\n\r\n")[0].decode().lower()
    job_id = [ln.split(":", 1)[1].strip() for ln in head.split("\r\n") if ln.startswith("x-dflash-job-id")][0]
    s.close()  # mid-stream: thousands of tokens still to go
    _wait_state(daemon, job_id, "cancelled")
    with daemon.client(timeout=5) as c:
        res = c.status(job_id).result
        assert res["finish_reason"] == "cancelled" and len(res["token_ids"]) < 4000
        assert c.stats()["jobs_cancelled"] > before


def test_disconnect_while_waiting_non_stream_cancels_the_job(gw, daemon):
    s = _raw_post(gw.port, {"messages": MSGS, "max_tokens": 4000})
    with daemon.client(timeout=5) as c:
        end = time.monotonic() + 15
        while not (running := [j for j in c.jobs() if j["state"] == "running"]):
            assert time.monotonic() < end, "the job never started"
            time.sleep(0.05)
    s.close()
    _wait_state(daemon, running[0]["job_id"], "cancelled")


def test_concurrent_http_clients_share_the_queue(gw, daemon):
    c = gw.openai()
    reqs = [("chat", f"Question {i}: what is {i} plus {i * 3}?", 10 + i) for i in range(3)] + \
           [("completion", f"Once upon a time {i}", 12) for i in range(2)]

    def run(r):
        kind, prompt, n = r
        if kind == "chat":
            out = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": prompt}], max_tokens=n)
            return out.choices[0].message.content, out.usage.completion_tokens, out.choices[0].finish_reason
        out = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=n)
        return out.choices[0].text, out.usage.completion_tokens, out.choices[0].finish_reason

    alone = [run(r) for r in reqs]
    with daemon.client(timeout=5) as dc:
        done_before = dc.stats()["jobs_done"]
        other = threading.Thread(target=lambda: dc.generate("Another app shares the worker.", max_tokens=8))
        other.start()  # a plain DFlashClient app in the same queue
        with ThreadPoolExecutor(len(reqs)) as pool:
            together = list(pool.map(run, reqs))
        other.join(30)
        assert together == alone
        assert dc.stats()["jobs_done"] - done_before == len(reqs) + 1


# ----------------------------------------------------------------------------- the command


def test_serve_refuses_what_it_cannot_do(tmp_path):
    from dflash.engine.cli import main

    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["serve", "--attach", "--runtime-dir", str(run), "--state-dir", str(tmp_path / "s")])
    assert res.exit_code != 0 and "no dflashd answers" in res.output
    res = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--runtime-dir", str(run)])
    assert res.exit_code != 0 and "needs --api-key" in res.output
    res = CliRunner().invoke(main, ["serve", "--runtime-dir", str(run), "--state-dir", str(tmp_path / "s")],
                             env={"DFLASH_MODEL": ""})
    assert res.exit_code != 0 and "no model configured" in res.output
    res = CliRunner().invoke(main, ["serve", "--attach", "--default-min-tokens-to-keep", "0", "--runtime-dir", str(run)])
    assert res.exit_code == 2 and "--default-min-tokens-to-keep" in res.output, res.output


def test_serve_starts_and_stops_its_own_daemon(tiny_pair, tmp_path):  # noqa: F811
    """Start mode: `serve` starts dflashd, answers, and on SIGTERM stops the daemon and exits."""
    import re
    import signal
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="dfs", dir="/tmp"))  # short: ipc paths are capped
    run, state = base / "run", base / "state"
    cmd = [sys.executable, "-m", "dflash.engine.cli", "serve", "--port", "0", "--stop-daemon",
           "--model", tiny_pair[0], "--draft", tiny_pair[1], "--runtime-dir", str(run),
           "--state-dir", str(state), "--blas", "none"]
    # unbuffered: select() must see every line (two arrive together here)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, bufsize=0)
    supervisor = None
    try:
        end, line, seen = time.monotonic() + 60, b"", b""
        while time.monotonic() < end and b"listening on" not in line:
            assert proc.poll() is None, f"serve exited {proc.returncode}: {seen!r}"
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
                seen += line
        assert b"listening on" in line, f"serve did not start: {seen!r}"
        supervisor = int(re.search(rb"supervisor (\d+)", seen).group(1))
        url = line.split(b"listening on ")[1].split()[0].decode()
        r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = r.models.list().data[0].id
        assert r.completions.create(model=model, prompt="hello", max_tokens=4).usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0  # no zombie supervisor keeps it waiting
        assert b"dflashd stopped" in proc.stdout.read()
        with pytest.raises(ProcessLookupError):  # the daemon it started is gone, and reaped
            os.kill(supervisor, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "stop", "--runtime-dir", str(run),
                        "--state-dir", str(state), "--timeout", "10"], capture_output=True, cwd=ROOT)


def _taken_port() -> socket.socket:
    """A listening socket on 127.0.0.1 (another server, as far as `serve` can tell)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _in_use(port: int) -> str:
    return (f"Error: cannot listen on 127.0.0.1:{port}: address already in use (another server? pick --port, "
            "or --port 0 for a free one)\n")


def test_serve_on_a_port_in_use_is_one_line(daemon, tiny_pair):  # noqa: F811
    """--attach, or starting a daemon: one line, exit 1, and no daemon started for nothing."""
    import tempfile

    from dflash.client import DFlashClient, WorkerUnavailableError
    from dflash.daemon.config import DaemonConfig

    serve = [sys.executable, "-m", "dflash.engine.cli", "serve"]
    base = Path(tempfile.mkdtemp(prefix="dfp", dir="/tmp"))  # short: ipc paths are capped
    dirs = ["--runtime-dir", str(base / "run"), "--state-dir", str(base / "state")]
    try:
        with _taken_port() as taken:
            port = taken.getsockname()[1]
            out = subprocess.run([*serve, "--attach", "--port", str(port), "--endpoint", daemon.endpoint,
                                  "--runtime-dir", daemon.cfg.runtime_dir, "--state-dir", daemon.cfg.state_dir],
                                 capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert out.returncode == 1 and out.stderr == _in_use(port) and not out.stdout, out.stderr
            out = subprocess.run([*serve, "--port", str(port), "--model", tiny_pair[0], "--draft", tiny_pair[1],
                                  *dirs, "--blas", "none"], capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert out.returncode == 1 and out.stderr == _in_use(port) and not out.stdout, out.stderr
        with DFlashClient(config=DaemonConfig(runtime_dir=str(base / "run")), timeout=0.5) as c, \
                pytest.raises(WorkerUnavailableError):
            c.stats()  # the port was checked first: no daemon was started
    finally:
        subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "stop", *dirs, "--timeout", "10"],
                       capture_output=True, cwd=ROOT)
        shutil.rmtree(base, ignore_errors=True)


def test_a_port_taken_after_the_check_is_one_line_too():
    """The gateway's own bind (a port taken between the check and it) fails the same way."""
    import asyncio

    import click

    from dflash.daemon.config import DaemonConfig
    from dflash.daemon.gateway import Gateway as App
    from dflash.daemon.gateway import run_gateway

    with _taken_port() as taken:
        port = taken.getsockname()[1]
        app = App("ipc:///tmp/dflash-gw-nowhere.sock", DaemonConfig())
        with pytest.raises(click.ClickException) as e:
            asyncio.run(run_gateway(app, "127.0.0.1", port, lambda url: pytest.fail(f"listening on {url}")))
    assert f"Error: {e.value.format_message()}\n" == _in_use(port)
