"""Session 42's hardening hunt: what a demanding daily user hit that the earlier hardening missed.
Real daemon and gateway processes on the tiny pair, real ZeroMQ and HTTP sockets."""

from __future__ import annotations

import json
import shutil

import pytest
from daemon_fixtures import make_daemon, raw_request, running, tiny_pair  # noqa: F401
from test_gateway import Gateway

from dflash.client import BadRequestError
from dflash.daemon import protocol as P


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


DROPPED = [  # (prompt, the field the prompt would drop, with its value)
    ([5, 6, 7], "system", "Answer like a pirate."),
    ([5, 6, 7], "template_args", {"enable_thinking": False}),
    ("hello", "template_args", {"enable_thinking": False}),  # raw text (below)
    ([{"role": "user", "content": "hi"}], "raw", True),
]


@pytest.mark.parametrize("prompt,name,value", DROPPED, ids=["ids-system", "ids-template-args", "raw-template-args",
                                                              "messages-raw"])
def test_a_field_the_prompt_would_drop_is_refused(daemon, prompt, name, value):
    """`system` or `template_args` with token ids (or raw text), and `raw` with messages, act
    through the chat template on a prompt that does not go through it: they were dropped without
    a word (the same ids as without them). Refused by the client before sending, and by the
    worker, naming the field; the daemon goes on."""
    kw = {name: value, **({"raw": True} if isinstance(prompt, str) else {})}
    with daemon.client(timeout=20) as c:
        with pytest.raises(BadRequestError) as exc:
            c.generate(prompt, max_tokens=3, **kw)
        assert (exc.value.code, exc.value.param) == ("bad_request", name) and name in exc.value.message
        where = "text" if isinstance(prompt, str) else "messages" if isinstance(prompt[0], dict) else "token_ids"
        reply = raw_request(daemon.endpoint, P.to_map(P.Submit(rid=4, max_tokens=3, **{where: prompt}, **kw)))
        assert (reply["type"], reply["code"], reply["param"], reply["rid"]) == ("error", "bad_request", name, 4), reply
        ok = c.generate(prompt, max_tokens=3, **{k: v for k, v in kw.items() if k != name})
        assert ok.finish_reason in ("stop", "length")
        assert c.stats()["restarts"] == 0


# The tiny model's template, written as many models' are: Qwen3's and others' keep their state in
# a namespace and count with range (names every Jinja template has, beside the request's
# variables); Mistral's and others' end each message with `+ eos_token` (a string the tokenizer
# passes in, which a template keyword argument replaces).
GLOBALS_TEMPLATE = (
    "{%- set ns = namespace(turns=0) %}{% for m in messages %}{% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] + eos_token }}\n{% endfor %}"
    "{% if effort is defined and effort not in ['low', 'high'] %}{{ raise_exception('effort: low or high') }}{% endif %}"
    "{% for _ in range(1) %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{% endfor %}")
CHAT_MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def globals_daemon(tiny_pair, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("globals") / "tiny-globals"
    shutil.copytree(tiny_pair[0], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = GLOBALS_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    yield from running((str(d), str(d / "draft")))


@pytest.mark.parametrize("name", ["namespace", "range", "dict", "cycler", "joiner", "lipsum"])
def test_template_kwargs_cannot_hide_the_templates_own_functions(globals_daemon, name):
    """chat_template_kwargs {"namespace": 1} replaced the template's namespace() (a render
    keyword wins over Jinja's globals): the template failed with a TypeError, not a
    TemplateError, so the job failed and the gateway answered 500 job_failed to a request's
    mistake. Refused at every door, naming the field, as the names apply_chat_template owns are."""
    d = globals_daemon
    g = Gateway(d)
    try:
        body = {"messages": CHAT_MSGS, "max_tokens": 2, "chat_template_kwargs": {name: 1}}
        status, _, raw = g.http("POST", "/v1/chat/completions", body)
        err = json.loads(raw)["error"]
        assert (status, err["param"], err["type"]) == (400, "chat_template_kwargs", "invalid_request_error"), err
        sub = P.to_map(P.Submit(rid=6, messages=CHAT_MSGS, max_tokens=2, stream=False, template_args={name: 1}))
        reply = raw_request(d.endpoint, sub)
        assert (reply["type"], reply["code"], reply["param"], reply["rid"]) == ("error", "bad_request", "template_args", 6)
        with d.client(timeout=20) as c:
            with pytest.raises(BadRequestError) as exc:
                c.generate(CHAT_MSGS, max_tokens=2, template_args={name: 1})
            assert exc.value.param == "template_args" and name in exc.value.message
            assert c.generate(CHAT_MSGS, max_tokens=2, template_args={"enable_thinking": False}).token_ids
        status, _, raw = g.http("POST", "/v1/chat/completions", {"messages": CHAT_MSGS, "max_tokens": 2})
        assert status == 200, raw
    finally:
        g.stop()


@pytest.mark.parametrize("kwargs,raised", [({"eos_token": 1}, "TypeError"), ({"eos_token": None}, "TypeError"),
                                           ({"eos_token": ["</s>"]}, "TypeError"), ({"effort": "max"}, "effort")],
                         ids=["int", "null", "list", "template-refuses"])
def test_a_template_kwarg_the_template_cannot_use_is_a_bad_request(globals_daemon, kwargs, raised):
    """chat_template_kwargs {"eos_token": 1}: the template adds it to a string and fails with a
    TypeError, which failed the job (HTTP 500 job_failed); one the template refuses itself
    (raise_exception) was blamed on the messages. The template renders without the request's
    kwargs, so they are at fault: 400 naming chat_template_kwargs (template_args on the wire);
    a plain kwarg still works."""
    d = globals_daemon
    g = Gateway(d)
    try:
        for stream in (False, True):
            body = {"messages": CHAT_MSGS, "max_tokens": 2, "stream": stream, "chat_template_kwargs": kwargs}
            status, _, raw = g.http("POST", "/v1/chat/completions", body)
            err = json.loads(raw)["error"]
            assert (status, err["param"], err["code"]) == (400, "chat_template_kwargs", "bad_request"), err
            assert "template_args" in err["message"] and raised in err["message"], err
        with d.client(timeout=20) as c:
            with pytest.raises(BadRequestError) as exc:
                c.generate(CHAT_MSGS, max_tokens=2, template_args=kwargs)
            assert exc.value.param == "template_args"
            assert c.generate(CHAT_MSGS, max_tokens=2, template_args={"eos_token": "<|im_end|>"}).token_ids
    finally:
        g.stop()


def test_a_bias_the_engine_refuses_is_refused_at_submit(daemon):  # noqa: F811
    """The engine refuses a logit_bias past +-1e30 (infinite in float32); the daemon accepted it
    (any finite number), queued the job and failed it (job_failed: dflash-client exit 1, as for
    a daemon fault). Now bad_sampling at submit, naming logit_bias, by the client and the worker."""
    from dflash.engine.processors import BIAS_MAX, PENALTY_MAX, REPETITION_MIN

    assert (P.BIAS_MAX, P.PENALTY_MAX, P.REPETITION_MIN) == (BIAS_MAX, PENALTY_MAX, REPETITION_MIN)  # the engine's
    for field, value in (("repetition_penalty", 1e-40), ("presence_penalty", 1e31), ("frequency_penalty", -1e31)):
        assert P.processors_problem({field: value})[0] == field
    with daemon.client(timeout=20) as c:
        with pytest.raises(BadRequestError) as exc:
            c.generate("hi", max_tokens=3, logit_bias={5: -1e31})
        assert (exc.value.code, exc.value.param) == ("bad_sampling", "logit_bias") and "1e+30" in exc.value.message
        reply = raw_request(daemon.endpoint, P.to_map(P.Submit(rid=3, text="hi", max_tokens=3, logit_bias={"5": 1e31})))
        assert (reply["type"], reply["code"], reply["param"], reply["rid"]) == ("error", "bad_sampling", "logit_bias", 3)
        assert c.generate("hi", max_tokens=3, logit_bias={5: -1e30}).finish_reason in ("stop", "length")


def test_a_bias_naming_one_token_twice_is_refused_at_every_door(daemon):  # noqa: F811
    """logit_bias {"5": 1, "05": 2} names token 5 twice: the gateway and the daemon took it, the
    engine refused it when the job ran (HTTP 500 job_failed). The Python client's {5: 1, "5": 2}
    kept one of the two without a word. A 400 / bad_sampling naming logit_bias at every door."""
    g = Gateway(daemon)
    try:
        status, _, raw = g.http("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                             "logit_bias": {"5": 1, "05": 2}})
        err = json.loads(raw)["error"]
        assert (status, err["param"], err["type"]) == (400, "logit_bias", "invalid_request_error"), err
        assert "twice" in err["message"]
        status, _, raw = g.http("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logit_bias": {"5": 1}})
        assert status == 200, raw
    finally:
        g.stop()
    reply = raw_request(daemon.endpoint, P.to_map(P.Submit(rid=2, text="hi", max_tokens=3,
                                                           logit_bias={"5": 1.0, "005": 2.0})))
    assert (reply["type"], reply["code"], reply["param"], reply["rid"]) == ("error", "bad_sampling", "logit_bias", 2)
    with daemon.client(timeout=20) as c:
        for bias in ({5: 1.0, "5": 2.0}, {5: 1.0, "05": 2.0}):
            with pytest.raises(BadRequestError) as exc:
                c.generate("hi", max_tokens=3, logit_bias=bias)
            assert (exc.value.code, exc.value.param) == ("bad_sampling", "logit_bias") and "twice" in exc.value.message
