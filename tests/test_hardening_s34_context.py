"""Session 34's hardening audit: a prompt longer than the model's context. The daemon bounded
prompts only by its own max_prompt_tokens (32768 by default), not by the model: a prompt past the
target's context (the tiny target's max_position_embeddings is 4096) ran its whole prefill and
came back as a 200 made from positions the model never saw. Now it is a 400 naming the prompt,
at every door, and the daemon goes on. Real daemon, gateway and sockets on a tiny model."""

from __future__ import annotations

import json

import pytest
from daemon_fixtures import running, tiny_pair  # noqa: F401
from test_gateway import KEY, Gateway, _error

from dflash.client import BadRequestError
from dflash.daemon import protocol as P

CONTEXT = 4096  # engine/tiny.py's max_position_embeddings


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


@pytest.fixture(scope="module")
def gw(daemon):
    with Gateway(daemon, "--api-key", KEY) as g:
        yield g


def test_a_prompt_past_the_models_context_is_a_bad_request(gw, daemon):
    with daemon.client() as c:
        assert c.models()[0]["block_size"] > 0
        with pytest.raises(BadRequestError) as exc:  # token ids: exactly the context, no room left
            c.generate(list(range(1, 200)) * (CONTEXT // 199 + 1), max_tokens=2)
        assert exc.value.param == "token_ids" and f"context of {CONTEXT} tokens" in exc.value.message
    long_text = "Tell me about the sea and its boats. " * 400  # ~ 6-7k tokens of the tiny tokenizer
    status, _, raw = gw.http("POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": long_text}], "max_tokens": 2})
    err = _error(status, raw)
    assert (status, err["code"], err["param"]) == (400, P.BAD_REQUEST, "messages"), err
    assert f"context of {CONTEXT} tokens" in err["message"]
    status, _, raw = gw.http("POST", "/v1/completions", {"prompt": long_text, "max_tokens": 2, "stream": True})
    assert (status, _error(status, raw)["param"]) == (400, "prompt")
    # a prompt that fits still runs
    status, _, raw = gw.http("POST", "/v1/completions", {"prompt": "Tell me about the sea.", "max_tokens": 3})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1
    assert daemon.proc.poll() is None
