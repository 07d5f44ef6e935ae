"""Session 34's hardening audit: what a request does to the chat template. Each test failed
before its fix: a chat_template_kwargs / template_args name that apply_chat_template owns (`self`,
`tokenize`, `chat_template`, ...) was accepted and failed its job (HTTP 500) or changed what the
model was given, and a model's template refusing a conversation (raise_exception: "roles must
alternate") failed the job (HTTP 500). Real daemon, gateway and sockets on a tiny model whose
template checks the conversation as Gemma's and Mistral's do."""

from __future__ import annotations

import json
import shutil

import pytest
from daemon_fixtures import Daemon, raw_request, tiny_pair  # noqa: F401
from test_gateway import KEY, Gateway, _error

from dflash.client import BadRequestError
from dflash.daemon import protocol as P

CHAT = "/v1/chat/completions"
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
# The tiny model's template, with the check Gemma's and Mistral's templates make.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GOOD = [{"role": "user", "content": "Tell me about the sea."}]
TWO_USERS = [{"role": "user", "content": "Tell me"}, {"role": "user", "content": "about the sea."}]
# Names apply_chat_template (or the template's helpers) own; each failed its job, or (chat_template,
# return_dict, truncation) silently changed what the model was given.
OWNED = [{"self": 1}, {"tokenize": False}, {"conversation": []}, {"return_tensors": "np"},
         {"chat_template": "{{ raise_exception('boom') }}"}, {"truncation": True, "max_length": 1},
         {"sanitize_control_tokens": True}, {"raise_exception": 1}]


@pytest.fixture(scope="module")
def daemon(tiny_pair, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("strict") / "tiny-strict"
    shutil.copytree(tiny_pair[0], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = STRICT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    dm = Daemon(str(d), str(d / "draft"))
    try:
        yield dm.start()
    finally:
        dm.stop()


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon, "--api-key", KEY) as g:
        yield g


def _still_serving(gw: Gateway, daemon: Daemon) -> None:
    status, _, raw = gw.http("POST", CHAT, {"messages": GOOD, "max_tokens": 3})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
    with daemon.client() as c:
        assert len(c.generate(GOOD, max_tokens=3).token_ids) >= 1
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("kwargs", OWNED, ids=[next(iter(k)) for k in OWNED])
def test_template_kwargs_apply_chat_template_owns_are_refused_at_every_door(gw, daemon, kwargs):
    # HTTP: a 400 naming the field (`self` was a 500 job_failed)
    status, _, raw = gw.http("POST", CHAT, {"messages": GOOD, "max_tokens": 2, "chat_template_kwargs": kwargs})
    err = _error(status, raw)
    assert (status, err["param"], err["type"]) == (400, "chat_template_kwargs", "invalid_request_error"), err
    # the wire: refused at submit, before a job exists (it was accepted, then failed or ran changed)
    sub = P.to_map(P.Submit(rid=5, messages=GOOD, max_tokens=2, stream=False, template_args=kwargs))
    reply = raw_request(daemon.endpoint, sub)
    assert (reply["type"], reply["code"], reply["param"], reply["rid"]) == ("error", P.BAD_REQUEST, "template_args", 5), reply
    assert "cannot be set" in reply["message"]
    # the Python client: the same refusal, nothing sent
    with daemon.client() as c, pytest.raises(BadRequestError) as exc:
        c.generate(GOOD, max_tokens=2, template_args=kwargs)
    assert exc.value.param == "template_args"
    _still_serving(gw, daemon)


def test_a_plain_template_kwarg_still_reaches_the_template(gw, daemon):
    status, _, raw = gw.http("POST", CHAT, {"messages": GOOD, "max_tokens": 2,
                                            "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, raw
    with daemon.client() as c:
        assert c.generate(GOOD, max_tokens=2, template_args={"enable_thinking": False}).finish_reason in ("stop", "length")


def test_a_conversation_the_models_template_refuses_is_a_bad_request(gw, daemon):
    status, _, raw = gw.http("POST", CHAT, {"messages": TWO_USERS, "max_tokens": 2})
    err = _error(status, raw)  # was 500 server_error / job_failed
    assert (status, err["code"], err["param"], err["type"]) == (400, P.BAD_REQUEST, "messages", "invalid_request_error"), err
    assert ALTERNATE in err["message"]
    # streamed: refused before the stream starts, so a status, not an event
    status, headers, raw = gw.http("POST", CHAT, {"messages": TWO_USERS, "max_tokens": 2, "stream": True})
    assert (status, _error(status, raw)["param"]) == (400, "messages")
    assert headers["content-type"].startswith("application/json")
    with daemon.client() as c:
        with pytest.raises(BadRequestError) as exc:
            c.generate(TWO_USERS, max_tokens=2)
        assert exc.value.param == "messages" and ALTERNATE in exc.value.message
        counters = c.stats()
    assert counters["state"] == "ready"
    _still_serving(gw, daemon)
