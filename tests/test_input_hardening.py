"""Hostile or careless input at every door (issue #13): the HTTP gateway answers 400 (never 500)
and leaks no paths, the Python clients refuse what they would misread, `dflash-client` refuses
non-UTF-8 text in one line, and job ids are matched whole. Real daemon, gateway and CLI processes
on a tiny model; raw HTTP, raw ZeroMQ and the official `openai` package."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from daemon_fixtures import ROOT, make_daemon, raw_request, tiny_pair  # noqa: F401
from test_gateway import KEY, MSGS, Gateway, _error, daemon, pair  # noqa: F401

from dflash.client import AsyncDFlashClient, BadRequestError, NotFoundError
from dflash.client.client import make_submit
from dflash.daemon import protocol as P

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _nest(depth: int) -> object:
    return json.loads("[" * depth + "]" * depth)


@pytest.fixture(scope="module")
def gw(daemon):  # noqa: F811
    """A gateway with the default body cap (1 MiB), as the issue's reports ran it."""
    g = Gateway(daemon, "--api-key", KEY)
    try:
        yield g
    finally:
        g.stop()


# ----------------------------------------------------------------------------- the gateway (4, 7, 10a)

# (path, raw body, wanted code): each of these was a 500 (UnicodeEncodeError, RecursionError,
# OverflowError in the gateway; RecursionError in the worker) before.
BODIES_THAT_WERE_500 = [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}', "invalid_json"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": "\\udfff", "max_tokens": 2}', "invalid_json"),
    (CHAT, b"[" * 100_000, "invalid_json"),
    (CHAT, json.dumps({"messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {"a": _nest(600)}}).encode(),
     "invalid_json"),
    (COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 10**20}).encode(), "invalid_value"),
    (COMPLETIONS, json.dumps({"prompt": [1, 10**20], "max_tokens": 2}).encode(), "invalid_value"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "top_k": 1e300}', "invalid_value"),
    (CHAT, json.dumps({"messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {"a": 2**70}}).encode(), "bad_request"),
]


@pytest.mark.parametrize("path,body,code", BODIES_THAT_WERE_500, ids=[
    "lone-surrogate", "surrogate-stop", "100k-nested", "deep-template-kwargs", "huge-max-tokens", "huge-token-id",
    "huge-top-k", "huge-template-kwarg"])
def test_bodies_that_crashed_are_400s(gw, path, body, code):  # noqa: F811
    status, headers, raw = gw.http("POST", path, body)
    err = _error(status, raw)
    assert (status, err["code"]) == (400, code), err
    assert err["type"] == "invalid_request_error" and headers["content-type"].startswith("application/json")
    assert len(err["message"]) < 200, err  # a huge number is cut short


def test_other_bodies_and_headers_are_4xx_and_the_gateway_goes_on(gw):  # noqa: F811
    # An API key that is not UTF-8 (byte 0xff in the header) is a wrong key, not a crash.
    status, _, raw = gw.http("POST", CHAT, {"messages": MSGS}, key=None, headers={"Authorization": "Bearer \xff"})
    assert (status, _error(status, raw)["code"]) == (401, "invalid_api_key")
    for body in (b"null", b'"text"', b"3", b"[]", b"true"):  # JSON, but not an object
        status, _, raw = gw.http("POST", CHAT, body)
        assert (status, _error(status, raw)["code"]) == (400, "invalid_type"), body
    body = b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"k\\udc00": 1}}'
    status, _, raw = gw.http("POST", CHAT, body)  # a lone surrogate in a key
    assert (status, _error(status, raw)["code"]) == (400, "invalid_json")
    r = gw.openai().chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")  # still serving


def test_template_kwarg_names_are_matched_whole(gw):  # noqa: F811
    """"enable_thinking\\n" is not a name: `$` matched before the newline, fullmatch does not."""
    body = {"messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking\n": False}}
    status, _, raw = gw.http("POST", CHAT, body)
    assert (status, _error(status, raw)["param"]) == (400, "chat_template_kwargs")


def test_models_retrieve(gw):  # noqa: F811
    m = gw.openai().models.retrieve("tiny-chat")
    assert (m.id, m.object, m.owned_by) == ("tiny-chat", "model", "dflash")
    assert m.model_extra["dflash"]["block_size"] > 0
    with pytest.raises(openai.NotFoundError) as exc:
        gw.openai().models.retrieve("gpt-9")
    assert exc.value.code == "model_not_found"
    status, _, raw = gw.http("GET", "/v1/models/gpt-9")
    assert (status, _error(status, raw)["code"], _error(status, raw)["param"]) == (404, "model_not_found", "model")
    with pytest.raises(openai.AuthenticationError):
        gw.openai(key="sk-wrong").models.retrieve("tiny-chat")


# ----------------------------------------------------------------------------- no paths in error bodies (10b)


def test_error_bodies_name_no_paths_the_log_does(make_daemon):  # noqa: F811
    d = make_daemon()
    g = Gateway(d, "--api-key", KEY)
    try:
        os.killpg(d.proc.pid, signal.SIGTERM)  # the daemon goes away under the gateway
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the daemon did not stop in 60 s after SIGTERM; its log:\n{d.logs()[-3000:]}")
        for path in ("/v1/models", CHAT):
            status, _, raw = g.http("POST" if path == CHAT else "GET", path, {"messages": MSGS} if path == CHAT else None)
            err = _error(status, raw)
            assert (status, err["code"]) == (503, "unavailable") and "no dflash worker answered" in err["message"]
            text = raw.decode()
            for leak in (d.endpoint, str(d.dir), "ipc://", "/tmp"):
                assert leak not in text, (leak, text)
        g.err.flush()
        assert d.endpoint in Path(g.err.name).read_text()  # the operator still sees where it looked
    finally:
        g.stop()


# ----------------------------------------------------------------------------- the Python clients (5)


def test_clients_refuse_bytes_prompts(daemon):  # noqa: F811
    with daemon.client(timeout=10) as c:
        done = c.stats()["jobs_done"]
        for prompt in (b"hello", bytearray(b"hello"), memoryview(b"hello")):
            with pytest.raises(TypeError, match="decode bytes"):
                c.generate(prompt, max_tokens=2)
            with pytest.raises(TypeError, match="decode bytes"):
                c.submit(prompt, max_tokens=2)

        async def run_async() -> None:
            ac = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=10)
            try:
                for prompt in (b"hello", bytearray(b"hello"), memoryview(b"hello")):
                    with pytest.raises(TypeError, match="decode bytes"):
                        await ac.generate(prompt, max_tokens=2)
                    with pytest.raises(TypeError, match="decode bytes"):
                        await ac.submit(prompt, max_tokens=2)
            finally:
                ac.close()

        asyncio.run(run_async())
        assert c.stats()["jobs_done"] == done and not c.jobs()  # nothing reached the worker


# (keywords, exception, message fragment): wrong types are TypeErrors, values the worker refuses
# are the BadRequestError it would answer; either way nothing is sent.
CLIENT_INPUTS = [
    (dict(prompt=[1, True]), TypeError, "item 1 must be an int, got bool"),
    (dict(prompt=[1, 2.0]), TypeError, "item 1 must be an int, got float"),
    (dict(prompt=["a", "b"]), TypeError, "item 0 must be an int, got str"),
    (dict(prompt=None), TypeError, "prompt must be"),
    (dict(prompt=[]), BadRequestError, "empty prompt"),
    (dict(prompt=[5, -1]), BadRequestError, ">= 0"),
    (dict(prompt=[1, 2**64]), BadRequestError, "token_ids"),
    (dict(prompt="hi \ud800"), BadRequestError, "not valid Unicode"),
    (dict(prompt="hi", max_tokens=True), TypeError, "max_tokens"),
    (dict(prompt="hi", max_tokens=4.0), TypeError, "max_tokens"),
    (dict(prompt="hi", priority=False), TypeError, "priority"),
    (dict(prompt="hi", temperature=True), TypeError, "temperature"),
    (dict(prompt="hi", temperature="0.5"), TypeError, "temperature"),
    (dict(prompt="hi", top_k=2.5), TypeError, "top_k"),
    (dict(prompt="hi", seed=2**64), BadRequestError, "seed"),
    (dict(prompt="hi", positions=[0, 1.5]), TypeError, "positions"),
    (dict(prompt="hi", positions=b"\x00\x01"), TypeError, "positions"),
    (dict(prompt="hi", raw="yes"), TypeError, "raw"),
    (dict(prompt="hi", system=b"be brief"), TypeError, "system"),
    (dict(prompt="hi", stop=["ok", "\udcff"]), BadRequestError, "stop"),
    (dict(prompt="hi", job_id="bad\n"), BadRequestError, "job_id"),
    (dict(prompt="hi", job_id="a/b"), BadRequestError, "job_id"),
]


def test_clients_refuse_what_they_would_misread(daemon):  # noqa: F811
    with daemon.client(timeout=10) as c:
        done = c.stats()["jobs_done"]
        for kw, exc, fragment in CLIENT_INPUTS:
            kw = dict(kw)
            with pytest.raises(exc) as info:
                c.generate(kw.pop("prompt"), max_tokens=kw.pop("max_tokens", 2), **kw)
            assert fragment in str(info.value), (kw, info.value)
        assert c.stats()["jobs_done"] == done and not c.jobs()
        # One string is one stop sequence (it used to become one per character).
        assert make_submit("hi", stop="END").stop == ["END"]
        assert c.generate([3, 4, 5], max_tokens=2, stop="END").finish_reason in ("stop", "length")


# ----------------------------------------------------------------------------- job ids (7)


def test_the_worker_matches_job_ids_whole(daemon):  # noqa: F811
    for job_id in ("bad\n", "ok\nrest", "x" * 65):
        reply = raw_request(daemon.endpoint, P.to_map(P.Submit(rid=7, job_id=job_id, text="hi", max_tokens=2)))
        assert (reply["type"], reply.get("code"), reply["rid"]) == ("error", P.BAD_REQUEST, 7), reply
    deep = P.to_map(P.Submit(rid=8, text="hi", max_tokens=2, template_args={"a": _nest(100)}))
    reply = raw_request(daemon.endpoint, deep)  # was an `internal` error (the job store recursed)
    assert (reply["type"], reply.get("code"), reply["param"]) == ("error", P.BAD_REQUEST, "template_args"), reply
    # a negative token id: refused by the clients' rule (check_submit), not accepted to fail later
    neg = raw_request(daemon.endpoint, P.to_map(P.Submit(rid=5, token_ids=[1, -3], max_tokens=2, stream=False)))
    assert (neg["type"], neg.get("code")) == ("error", P.BAD_REQUEST) and ">= 0" in neg["message"], neg
    assert neg["param"] == "token_ids"
    # every error about one field names it (`param`), so no client reads it out of the message
    for fields, param in (({"max_tokens": 10**6}, "max_tokens"), ({"priority": 5000}, "priority"),
                          ({"stop": ["x"] * 17}, "stop"), ({"cache": "sometimes"}, "cache"),
                          ({"temperature": -1.0}, "temperature")):
        reply = raw_request(daemon.endpoint, {**P.to_map(P.Submit(rid=6, job_id="refused-1", text="hi",
                                                                   max_tokens=2)), **fields})
        assert (reply["type"], reply["param"], reply["job_id"]) == ("error", param, ""), reply  # nothing queued
    with daemon.client(timeout=10) as c, pytest.raises(BadRequestError) as e:
        c.generate("hi", max_tokens=10**6)
    assert e.value.param == "max_tokens"
    for op in (P.Cancel, P.JobStatus):  # a malformed id is a bad request, not an unknown job
        for job_id in ("bad\n", "", "x" * 65, "a b"):
            reply = raw_request(daemon.endpoint, P.to_map(op(rid=9, job_id=job_id)))
            assert (reply["type"], reply.get("code"), reply["rid"]) == ("error", P.BAD_REQUEST, 9), (op, reply)
    with daemon.client(timeout=10) as c:
        with pytest.raises(BadRequestError):
            c.status("bad\n")
        with pytest.raises(NotFoundError):
            c.status("never-sent")  # well-formed but unknown: still not_found
        assert len(c.generate("hi", job_id="good-1.x_y", max_tokens=2).token_ids) == 2  # valid ids still work


# ----------------------------------------------------------------------------- dflash-client (6)


def _cli(daemon, args: list, stdin: bytes = b"", lc_all: str = "C.UTF-8") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint, *args],
                          input=stdin, capture_output=True, timeout=60, cwd=ROOT,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONUTF8"}, "LC_ALL": lc_all})


@pytest.mark.parametrize("lc_all", ["C.UTF-8", "C"])
def test_cli_refuses_non_utf8_in_one_line(daemon, lc_all):  # noqa: F811
    cases = [(["prompt", "-m", "2"], b"hi \xff there"),  # stdin
             (["prompt", "-m", "2", b"hi \xfe there"], b""),  # an argument (argv keeps it as a surrogate)
             (["prompt", "-m", "2", "--system", b"be \xe9 brief", "hi"], b""),
             (["prompt", "-m", "2", "--positions-name", b"n\xff", "hi"], b"")]
    for args, stdin in cases:
        out = _cli(daemon, args, stdin, lc_all)
        err = out.stderr.decode(errors="replace")
        assert out.returncode == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("dflash-client: ") and ("UTF-8" in err or "Unicode" in err), err
        assert "Traceback" not in err
    ok = _cli(daemon, ["prompt", "-m", "2"], "héllo wörld".encode(), lc_all)  # UTF-8 is fine
    assert ok.returncode == 0, ok.stderr


def test_a_plain_window_on_a_sliding_window_target_is_a_bad_request(tiny_dirs):
    """verify_window 1 (what `--compare-plain` sends) on a target whose ring cache cannot undo
    one token: a bad_request naming why, before any work; the daemon serves on."""
    from daemon_fixtures import Daemon

    d = tiny_dirs["gemma3_text"]
    daemon_ = Daemon(str(d), str(d / "draft")).start()
    try:
        with daemon_.client(timeout=60) as c:
            with pytest.raises(BadRequestError, match="sliding-window cache cannot undo"):
                c.generate("hello", max_tokens=4, verify_window=1)
            assert len(c.generate("hello", max_tokens=4).token_ids) >= 1
    finally:
        daemon_.stop()


def test_the_library_checks_what_it_is_handed(pairs):
    """stream_dflash_generate: an id past the vocabulary was a segfault in MLX's embedding
    lookup, a negative one an OverflowError, bytes were taken as ids, max_tokens 2.5 ran, a
    stop string was split into characters. Each is a clear error now (or, one stop string,
    taken whole)."""
    from dflash.engine.generate import stream_dflash_generate

    pair = pairs("qwen3")
    v = pair.target.vocab_size

    def run(prompt, max_tokens=4, **kw):
        return list(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, prompt, max_tokens, **kw))

    for prompt, err, msg in (([v], ValueError, "outside the vocabulary"), ([2**70], ValueError, "outside"),
                             ([-1], ValueError, "outside"), (b"Hi", TypeError, "not bytes"),
                             ([1, "2"], TypeError, "must be ints"), ([True], TypeError, "must be ints")):
        with pytest.raises(err, match=msg):
            run(prompt)
    for bad in (2.5, True, "4"):
        with pytest.raises(TypeError, match="max_tokens must be an int"):
            run([1, 2, 3], bad)
    with pytest.raises(TypeError, match="stop must be"):
        run([1, 2, 3], stop=[1])
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        whole = run("Once upon a time", 40, stop="zzzzqq ")[-1]
        free = run("Once upon a time", 40)[-1]
        split = run("Once upon a time", 40, stop=list("zzzzqq "))[-1]
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert whole.token_ids == free.token_ids and split.text != free.text  # the split one stops early
