"""Sampling parameters, and (version 3) one job's verify window, through every interface but
HTTP (that is test_gateway.py): `dflash generate`, wire protocol versions 2 to 5, the daemon, DFlashClient / AsyncDFlashClient and
`dflash-client`. Real processes, real ZeroMQ, the tiny real model; the reference is the
in-process engine with the same seed (and the same fixed verify window: a seed repeats its ids
only under a fixed window, so the daemon here runs with verify_window = "full")."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import msgpack
import pytest
import zmq
from click.testing import CliRunner
from daemon_fixtures import PROMPTS, Daemon, raw_request, running, reference, tiny_pair  # noqa: F401

from dflash.client import AsyncDFlashClient, BadRequestError, DFlashClient, ProtocolVersionError
from dflash.daemon import protocol as P

PROMPT = PROMPTS[4]
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50, seed=11)
FULL = dict(verify_window="full")
WPROMPT = PROMPTS[6]
WSAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50, seed=5)


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, verify_window="full")


@pytest.fixture
def client(daemon):
    with daemon.client(timeout=20) as c:
        yield c


# ----------------------------------------------------------------------------- the daemon


def test_seeded_sampling_through_the_daemon_equals_in_process(client, tiny_pair):  # noqa: F811
    _, want = reference(tiny_pair, PROMPT, 16, **SAMPLED, **FULL)
    _, greedy = reference(tiny_pair, PROMPT, 16)
    assert want != greedy  # the params do something
    first = client.generate(PROMPT, max_tokens=16, **SAMPLED)
    assert first.token_ids == want
    assert first.stats["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 11, "min_p": 0.0,
                                       "min_tokens_to_keep": 1}
    again = client.generate(PROMPT, max_tokens=16, **SAMPLED)  # now from the prefix cache
    assert again.token_ids == want and again.stats["cached_prompt_tokens"] > 0
    with client.stream(PROMPT, max_tokens=16, **SAMPLED) as s:
        assert [t for d in s for t in d.token_ids] == want
    other = client.generate(PROMPT, max_tokens=16, **{**SAMPLED, "seed": 12})
    assert other.token_ids == reference(tiny_pair, PROMPT, 16, **{**SAMPLED, "seed": 12}, **FULL)[1] != want
    plain = client.generate(PROMPT, max_tokens=16)  # temperature 0 (the default): greedy as before
    assert plain.token_ids == greedy and plain.stats["sampling"]["temperature"] == 0.0
    assert client.generate(PROMPT, max_tokens=16, temperature=0, seed=3).token_ids == greedy


def test_unseeded_job_reports_its_drawn_seed(client, tiny_pair):  # noqa: F811
    a = client.generate(PROMPT, max_tokens=12, temperature=1.0)
    seed = a.stats["sampling"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**63
    assert client.generate(PROMPT, max_tokens=12, temperature=1.0, seed=seed).token_ids == a.token_ids
    h = client.submit(PROMPT, max_tokens=12, temperature=1.0, seed=seed)  # detached jobs too
    assert h.result(timeout=30).token_ids == a.token_ids


def test_async_client_takes_the_same_params(daemon, tiny_pair):  # noqa: F811
    async def go() -> tuple[list[int], list[int]]:
        a = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=20)
        try:
            res = await a.generate(PROMPT, max_tokens=16, **SAMPLED)
            streamed = [t async for ev in a.stream(PROMPT, max_tokens=16, **SAMPLED) for t in ev.token_ids]
            return res.token_ids, streamed
        finally:
            a.close()

    ids, streamed = asyncio.run(go())
    want = reference(tiny_pair, PROMPT, 16, **SAMPLED, **FULL)[1]
    assert ids == want and streamed == want + want  # deltas' ids, then the Result's


def test_bad_sampling_values_are_refused_and_the_daemon_survives(client, daemon):
    pid = client.stats()["pid"]
    for kw, field in [({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                      ({"seed": -1}, "seed"), ({"seed": 1 << 64}, "seed"), ({"min_p": -0.1}, "min_p"),
                      ({"min_p": 1.01}, "min_p"), ({"min_p": float("nan")}, "min_p")]:
        with pytest.raises(BadRequestError) as e:
            client.generate(PROMPT, max_tokens=4, **kw)
        assert e.value.code == P.BAD_SAMPLING and field in e.value.message, (kw, e.value)
    with pytest.raises(TypeError):  # caught before the wire: 2.5 tokens is not a top_k
        client.generate(PROMPT, max_tokens=4, top_k=2.5)
    # the worker's own check, and what only a foreign client can send: wrong wire types
    for bad, code in [({"temperature": "hot"}, P.BAD_REQUEST), ({"top_k": 1.5}, P.BAD_REQUEST),
                      ({"seed": True}, P.BAD_REQUEST), ({"temperature": -1.0}, P.BAD_SAMPLING),
                      ({"top_p": 2.0}, P.BAD_SAMPLING), ({"seed": -5}, P.BAD_SAMPLING),
                      ({"min_p": "x"}, P.BAD_REQUEST), ({"min_p": 1.5}, P.BAD_SAMPLING)]:
        reply = raw_request(daemon.endpoint, {"v": P.VERSION, "op": "submit", "rid": 5, "text": "x", **bad})
        assert (reply["type"], reply["code"], reply["rid"]) == ("error", code, 5), reply
    st = client.stats()
    assert st["pid"] == pid and st["state"] == "ready" and st["protocol"] == P.VERSION
    assert st["generation"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "min_p": 0.0,
                                "min_tokens_to_keep": 1, "repetition_penalty": 1.0, "repetition_context_size": 20, "presence_penalty": 0.0,
                                "presence_context_size": 20, "frequency_penalty": 0.0, "frequency_context_size": 20,
                                "verify_window": "full"}
    # the limits a client fits its requests to (the daemon fixture's config, as it runs)
    assert st["limits"] == {k: getattr(daemon.cfg, k) for k in
                            ("max_queue", "max_tokens_limit", "max_prompt_tokens", "max_frame_bytes", "max_attempts")}
    assert len(client.generate(PROMPT, max_tokens=4, **SAMPLED).token_ids) == 4  # still serving


def test_min_p_through_the_daemon_equals_in_process(client, tiny_pair):  # noqa: F811
    """min_p (version 4) reaches the engine: the same ids as the in-process engine with it, other
    ids than without it, and done.stats.sampling says so."""
    kw = {**SAMPLED, "temperature": 1.5, "top_p": 1.0, "top_k": 0, "min_p": 0.2}
    want = reference(tiny_pair, PROMPT, 16, **kw, **FULL)[1]
    assert want != reference(tiny_pair, PROMPT, 16, **{**kw, "min_p": 0.0}, **FULL)[1]  # it does something
    res = client.generate(PROMPT, max_tokens=16, **kw)
    assert res.token_ids == want and res.stats["sampling"] == {**kw, "min_tokens_to_keep": 1}


# min-p at 1 keeps only the most likely token (the tiny random model is near-uniform: any lower
# cut keeps hundreds), so what is sampled is min_tokens_to_keep's own choice: the 5 most likely
KEEP = {**SAMPLED, "temperature": 1.5, "top_p": 1.0, "top_k": 0, "min_p": 1.0, "min_tokens_to_keep": 5}


def test_min_tokens_to_keep_through_the_daemon_equals_in_process(client, daemon, tiny_pair):  # noqa: F811
    """min_tokens_to_keep (version 5) reaches the engine from DFlashClient, AsyncDFlashClient and
    the wire: the in-process engine's ids with it, other ids than without it (min-p alone, here
    greedy), and done.stats.sampling says so (1, mlx-lm's default, when a request leaves it out)."""
    want = reference(tiny_pair, PROMPT, 16, **KEEP, **FULL)[1]
    alone = reference(tiny_pair, PROMPT, 16, **{**KEEP, "min_tokens_to_keep": 1}, **FULL)[1]
    assert want != alone == reference(tiny_pair, PROMPT, 16)[1]  # it does something; min-p 1 alone is greedy
    res = client.generate(PROMPT, max_tokens=16, **KEEP)
    assert res.token_ids == want and res.stats["sampling"] == KEEP
    one = client.generate(PROMPT, max_tokens=16, **{**KEEP, "min_tokens_to_keep": 1})
    assert one.token_ids == alone and one.stats["sampling"]["min_tokens_to_keep"] == 1
    unset = client.generate(PROMPT, max_tokens=16, **{k: v for k, v in KEEP.items() if k != "min_tokens_to_keep"})
    assert unset.token_ids == alone and unset.stats["sampling"]["min_tokens_to_keep"] == 1  # the daemon's default
    h = client.submit(PROMPT, max_tokens=16, **KEEP)  # a detached job carries it too
    assert h.result(timeout=30).token_ids == want

    async def go() -> list[int]:
        a = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=20)
        try:
            return (await a.generate(PROMPT, max_tokens=16, **KEEP)).token_ids
        finally:
            a.close()

    assert asyncio.run(go()) == want
    wire = raw_request(daemon.endpoint, {"v": P.VERSION, "op": "submit", "rid": 8, "text": PROMPT, "max_tokens": 16,
                                         "stream": False, **KEEP})
    assert wire["type"] == "accepted"
    assert client.job(wire["job_id"]).result(timeout=30).token_ids == want


def test_bad_min_tokens_to_keep_is_refused_with_its_name(client, daemon):
    pid = client.stats()["pid"]
    for bad in (0, -3, 1 << 64):  # refused by the client, before the wire, as the worker would
        with pytest.raises(BadRequestError) as e:
            client.generate(PROMPT, max_tokens=4, min_p=0.1, min_tokens_to_keep=bad)
        assert (e.value.code, e.value.param) == (P.BAD_SAMPLING, "min_tokens_to_keep")
        assert "min_tokens_to_keep must be an integer >= 1" in e.value.message, e.value
    for bad in (2.5, True, "3"):
        with pytest.raises(TypeError, match="min_tokens_to_keep"):
            client.generate(PROMPT, max_tokens=4, min_p=0.1, min_tokens_to_keep=bad)
    for bad, code in [(0, P.BAD_SAMPLING), (-1, P.BAD_SAMPLING), (2.5, P.BAD_REQUEST), ("4", P.BAD_REQUEST),
                      (True, P.BAD_REQUEST)]:  # the worker's own check: what a foreign client can send
        reply = raw_request(daemon.endpoint, {"v": P.VERSION, "op": "submit", "rid": 9, "text": "x",
                                              "min_tokens_to_keep": bad})
        assert (reply["type"], reply["code"], reply["rid"], reply["param"]) == ("error", code, 9, "min_tokens_to_keep")
        assert "min_tokens_to_keep" in reply["message"]
    assert client.stats()["pid"] == pid


PROCS = {"logit_bias": {"5": 3.0}, "repetition_penalty": 1.8, "repetition_context_size": 30,
         "frequency_penalty": 0.6, "frequency_context_size": 20}


def test_processors_through_the_daemon_equal_in_process(client, daemon, tiny_pair):  # noqa: F811
    """Logits processors (version 4) reach the engine, greedy and sampled: the in-process
    engine's ids with them, other ids than without them; stats.sampling lists those applied;
    bad values are refused on the way in and the daemon goes on."""
    greedy = reference(tiny_pair, PROMPT, 16)[1]
    want = reference(tiny_pair, PROMPT, 16, **PROCS)[1]
    assert want != greedy
    res = client.generate(PROMPT, max_tokens=16, **{**PROCS, "logit_bias": {5: 3.0}})  # int ids are taken
    assert res.token_ids == want and res.stats["sampling"] == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "min_p": 0.0, "min_tokens_to_keep": 1, **PROCS}
    sampled = reference(tiny_pair, PROMPT, 16, **SAMPLED, **PROCS, **FULL)[1]
    assert client.generate(PROMPT, max_tokens=16, **SAMPLED, **PROCS).token_ids == sampled
    neutral = client.generate(PROMPT, max_tokens=16, repetition_penalty=1.0, presence_penalty=0, logit_bias={})
    assert neutral.token_ids == greedy and "repetition_penalty" not in neutral.stats["sampling"]
    pid = client.stats()["pid"]
    for kw, field in [({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": float("nan")},
                      "presence_penalty"), ({"frequency_context_size": 0}, "frequency_context_size"),
                      ({"logit_bias": {-3: 1.0}}, "logit_bias"), ({"logit_bias": {10**9: 1.0}}, "logit_bias")]:
        with pytest.raises(BadRequestError) as e:
            client.generate(PROMPT, max_tokens=4, **kw)
        assert e.value.code == P.BAD_SAMPLING and e.value.param == field and field in e.value.message, (kw, e.value)
    for bad, code in [({"logit_bias": {"5": "up"}}, P.BAD_SAMPLING), ({"logit_bias": [5]}, P.BAD_REQUEST),
                      ({"repetition_penalty": -1.0}, P.BAD_SAMPLING), ({"presence_context_size": 1.5}, P.BAD_REQUEST)]:
        reply = raw_request(daemon.endpoint, {"v": P.VERSION, "op": "submit", "rid": 6, "text": "x", **bad})
        assert (reply["type"], reply["code"], reply["rid"]) == ("error", code, 6), reply
    with pytest.raises(TypeError):
        client.generate(PROMPT, max_tokens=4, logit_bias={5: "up"})
    assert client.stats()["pid"] == pid


def test_config_defaults_apply_when_a_request_leaves_them_unset(tiny_pair):  # noqa: F811
    d = Daemon(*tiny_pair, verify_window="full", temperature=0.8, top_p=0.95, top_k=50, seed=11, cache=False,
               min_tokens_to_keep=5)
    try:
        d.start()
        with d.client(timeout=20) as c:
            want = reference(tiny_pair, PROMPT, 16, **SAMPLED, **FULL)[1]
            res = c.generate(PROMPT, max_tokens=16)  # min_tokens_to_keep changes nothing without min-p
            assert res.token_ids == want
            assert res.stats["sampling"] == {**SAMPLED, "min_p": 0.0, "min_tokens_to_keep": 5}
            greedy = c.generate(PROMPT, max_tokens=16, temperature=0)  # a request's own value wins
            assert greedy.token_ids == reference(tiny_pair, PROMPT, 16)[1]
            assert greedy.stats["sampling"] == {"temperature": 0.0, "top_p": 0.95, "top_k": 50, "seed": 11, "min_p": 0.0,
                                                "min_tokens_to_keep": 5}
            # the [generation] min_tokens_to_keep applies to a request that sets min_p but not it
            kept = c.generate(PROMPT, max_tokens=16, **{k: v for k, v in KEEP.items() if k != "min_tokens_to_keep"})
            assert kept.token_ids == reference(tiny_pair, PROMPT, 16, **KEEP, **FULL)[1]
            assert c.stats()["generation"]["min_tokens_to_keep"] == 5
    finally:
        d.stop()


# ----------------------------------------------------------------------------- a job's verify window (v3)


def test_a_job_window_overrides_the_worker_setting(client, tiny_pair):  # noqa: F811
    greedy = reference(tiny_pair, WPROMPT, 16)[1]
    full = client.generate(WPROMPT, max_tokens=16)  # the worker's setting: the whole block
    assert full.token_ids == greedy and full.stats["verify_window"] == "full"
    assert full.stats["mean_verify_window"] == full.stats["block_size"]
    plain = client.generate(WPROMPT, max_tokens=16, verify_window=1)
    assert plain.token_ids == greedy and plain.stats["verify_window"] == 1
    assert plain.stats["accepted_drafts"] == 0 and plain.stats["mean_verify_window"] == 1.0
    assert plain.stats["plain_steps"] == plain.stats["cycles"] == 15  # the prefill gives the first token
    four = client.generate(WPROMPT, max_tokens=16, verify_window=4)
    assert four.token_ids == greedy and four.stats["mean_verify_window"] <= 4
    auto = client.generate(WPROMPT, max_tokens=16, verify_window="auto", cache="bypass")
    assert auto.token_ids == greedy and auto.stats["verify_window"] == "auto"
    # a seed repeats its ids under a fixed window: the job's own window is the one that counts
    sampled = client.generate(WPROMPT, max_tokens=16, verify_window=4, **WSAMPLED)
    assert sampled.token_ids == reference(tiny_pair, WPROMPT, 16, verify_window=4, **WSAMPLED)[1]
    assert client.stats()["generation"]["verify_window"] == "full"  # the worker's setting stays


def test_bad_windows_are_refused_and_the_daemon_survives(client, daemon):
    pid = client.stats()["pid"]
    for bad in (0, -2, "8", "whole"):
        with pytest.raises(BadRequestError) as e:  # refused by the client, before the wire
            client.generate(WPROMPT, max_tokens=4, verify_window=bad)
        assert e.value.code == P.BAD_REQUEST and "verify_window must be" in e.value.message
    with pytest.raises(TypeError):
        client.generate(WPROMPT, max_tokens=4, verify_window=2.5)
    for bad in (0, "8", 2.5, True, [1]):  # the worker's own check: what a foreign client can send
        reply = raw_request(daemon.endpoint, {"v": P.VERSION, "op": "submit", "rid": 7, "text": "x", "verify_window": bad})
        assert (reply["type"], reply["code"], reply["rid"]) == ("error", P.BAD_REQUEST, 7), reply
        assert "verify_window" in reply["message"]
    with pytest.raises(BadRequestError) as e:  # a count over the block: the job's error when it starts
        client.generate(WPROMPT, max_tokens=4, verify_window=99)
    assert e.value.code == P.BAD_REQUEST and "block of 16 tokens" in e.value.message
    st = client.stats()
    assert st["pid"] == pid and st["state"] == "ready"
    assert len(client.generate(WPROMPT, max_tokens=4, verify_window=2).token_ids) == 4  # still serving


def test_dflash_client_compare_plain(daemon, tiny_pair):  # noqa: F811
    from dflash.client.cli import main

    greedy = reference(tiny_pair, WPROMPT, 12)[1]
    base = ["--endpoint", daemon.endpoint, "--timeout", "20", "prompt", "-m", "12"]
    res = CliRunner().invoke(main, [*base, "--json", "--compare-plain", WPROMPT])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["token_ids"] == greedy and out["stats"]["verify_window"] == "full"
    plain = out["plain"]
    assert plain["same_tokens"] and plain["parts_at"] is None and plain["greedy"]
    assert plain["generated_tokens"] == 12 and plain["stats"]["verify_window"] == 1
    assert plain["stats"]["cached_prompt_tokens"] == 0  # the plain run bypasses the prefix cache
    assert plain["speedup"] == pytest.approx(out["stats"]["decode_tps"] / plain["decode_tps"])
    # the human form: the text, the job's stats line, then the comparison, on stderr
    res = CliRunner().invoke(main, [*base, "--stats", "--verify-window", "4", "--compare-plain", WPROMPT])
    assert res.exit_code == 0, res.output
    err = res.stderr.splitlines()
    assert err[0].startswith("[dflash] prompt ") and "decoding the same prompt plainly" in err[1]
    assert "x plain decoding (measured)" in err[2] and "the same tokens: yes" in err[2], err
    # sampled: the same seed, but no claim that the texts agree
    res = CliRunner().invoke(main, [*base, "--compare-plain", "--temperature", "0.8", "--seed", "5", WPROMPT])
    assert res.exit_code == 0 and "two draws from the same distribution" in res.stderr, res.output
    for flags in (["--verify-window", "0"], ["--verify-window", "whole"]):
        res = CliRunner().invoke(main, [*base, *flags, WPROMPT])
        assert res.exit_code == 2 and "verify_window must be" in res.output, (flags, res.output)


# ----------------------------------------------------------------------------- versions


def test_an_old_client_gets_a_version_error_it_can_read(daemon, client):
    """A version-1 client's submit: the error comes back stamped version 1 (so that client's
    decoder accepts it), with the code bad_version and both versions in the message."""
    v1_submit = {"v": 1, "op": "submit", "rid": 9, "job_id": "", "text": "hi", "max_tokens": 4}
    reply = raw_request(daemon.endpoint, v1_submit)
    assert (reply["v"], reply["type"], reply["code"], reply["rid"]) == (1, "error", P.BAD_VERSION, 9)
    assert "request is version 1" in reply["message"] and f"speaks version {P.VERSION}" in reply["message"]
    # the previous version's (4) submit, min_p and all: its own version back, naming both
    v4 = raw_request(daemon.endpoint, {"v": 4, "op": "submit", "rid": 10, "text": "hi", "min_p": 0.1})
    assert (v4["v"], v4["type"], v4["code"], v4["rid"], v4["param"]) == (4, "error", P.BAD_VERSION, 10, "")
    assert "request is version 4" in v4["message"] and f"speaks version {P.VERSION}" in v4["message"]
    future = raw_request(daemon.endpoint, {"v": P.VERSION + 1, "op": "stats", "rid": 2})
    assert (future["v"], future["code"]) == (P.VERSION, P.BAD_VERSION)  # unknown: our own version
    assert client.stats()["state"] == "ready"


def test_a_new_client_names_both_versions_when_the_worker_is_old(tmp_path):
    """A worker still on version 1 answers every version-2 request the way version 1 did; the
    client raises ProtocolVersionError naming both versions instead of a decoding failure."""
    endpoint = f"ipc://{tmp_path}/old.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    stop = threading.Event()

    def old_worker() -> None:  # version 1's answer to a request of another version
        while not stop.is_set():
            if router.poll(50):
                ident, frame = router.recv_multipart()
                m = msgpack.unpackb(frame)
                router.send_multipart([ident, msgpack.packb(
                    {"v": 1, "type": "error", "rid": m.get("rid", 0), "code": "bad_version",
                     "message": f"protocol version {m.get('v')!r} not supported (want 1)", "job_id": ""})])

    t = threading.Thread(target=old_worker, daemon=True)
    t.start()
    try:
        with DFlashClient(endpoint, timeout=5) as c:
            for call in (c.stats, lambda: c.generate("hi", max_tokens=4, temperature=0.5)):
                with pytest.raises(ProtocolVersionError) as e:
                    call()
                assert e.value.code == P.BAD_VERSION and isinstance(e.value, BadRequestError)
                assert "reply is version 1" in e.value.message and f"speaks version {P.VERSION}" in e.value.message

        async def go() -> None:
            a = AsyncDFlashClient(endpoint, timeout=5)
            try:
                with pytest.raises(ProtocolVersionError):
                    await a.stats()
            finally:
                a.close()

        asyncio.run(go())
    finally:
        stop.set()
        t.join(5)
        router.close(0)
        ctx.term()


# ----------------------------------------------------------------------------- command lines


def test_dflash_client_prompt_flags(daemon, tiny_pair):  # noqa: F811
    from dflash.client.cli import main

    base = ["--endpoint", daemon.endpoint, "--timeout", "20", "prompt", "--json", "-m", "16"]
    res = CliRunner().invoke(main, [*base, "--temperature", "0.8", "--top-p", "0.95", "--top-k", "50",
                                    "--seed", "11", PROMPT])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, **SAMPLED, **FULL)[1]
    assert out["stats"]["sampling"] == {**SAMPLED, "min_p": 0.0, "min_tokens_to_keep": 1}
    res = CliRunner().invoke(main, [*base, "--temperature", "1.5", "--min-p", "0.2", "--seed", "11", PROMPT])
    out = json.loads(res.output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, temperature=1.5, min_p=0.2, seed=11, **FULL)[1]
    assert out["stats"]["sampling"]["min_p"] == 0.2
    keep = ["--temperature", "1.5", "--min-p", "1", "--min-tokens-to-keep", "5", "--seed", "11"]
    out = json.loads(CliRunner().invoke(main, [*base, *keep, PROMPT]).output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, **KEEP, **FULL)[1]
    assert out["stats"]["sampling"]["min_tokens_to_keep"] == 5
    flags = ["--logit-bias", "5=3", "--repetition-penalty", "1.8", "--repetition-context-size", "30",
             "--frequency-penalty", "0.6"]
    out = json.loads(CliRunner().invoke(main, [*base, *flags, PROMPT]).output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, **PROCS)[1]
    for flags, word in [(["--logit-bias", "x=1"], "ID=BIAS"), (["--logit-bias", "5=inf"], "finite"),
                        (["--repetition-context-size", "0"], "--repetition-context-size"),
                        (["--presence-penalty", "nan"], "finite")]:
        res = CliRunner().invoke(main, [*base, *flags, PROMPT])
        assert res.exit_code == 2 and word in res.output, (flags, res.output)
    res = CliRunner().invoke(main, [*base, "--repetition-penalty", "0", PROMPT])  # the protocol's rule
    assert res.exit_code != 0 and "repetition_penalty must be" in res.output, res.output
    # --stats names the seed too (here drawn by the worker: what repeats the job)
    res = CliRunner().invoke(main, [*base[:-3], "--stats", "-m", "4", "--temperature", "0.8", PROMPT])
    assert res.exit_code == 0, res.output
    seed = re.search(r"sampling: temperature 0.8, top_p 1, top_k 0, seed (\d+)", res.stderr)
    assert seed, res.stderr
    again = CliRunner().invoke(main, [*base, "--temperature", "0.8", "-m", "4", "--seed", seed.group(1), PROMPT])
    assert json.loads(again.output)["stats"]["sampling"]["seed"] == int(seed.group(1))
    for flags, word in [(["--temperature", "-1"], "--temperature"), (["--temperature", "inf"], "finite"),
                        (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
                        (["--top-k", "-3"], "--top-k"), (["--seed", "-1"], "--seed"), (["--min-p", "1.5"], "--min-p"),
                        (["--min-p", "nan"], "finite"), (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
                        (["--min-tokens-to-keep", "2.5"], "--min-tokens-to-keep")]:
        res = CliRunner().invoke(main, [*base, *flags, PROMPT])
        assert res.exit_code == 2 and word in res.output, (flags, res.output)
    res = CliRunner().invoke(main, [*base, "--min-tokens-to-keep", str(1 << 64), PROMPT])  # the protocol's rule
    assert res.exit_code != 0 and "min_tokens_to_keep must be an integer >= 1" in res.output, res.output


def test_dflash_generate_compare_plain(tiny_pair):  # noqa: F811
    """`dflash generate --compare-plain`: the same prompt decoded plainly in the same process."""
    from dflash.engine.cli import main

    model, draft = tiny_pair
    run = CliRunner(env={"DFLASH_BLAS": "none"})
    base = ["generate", "--model", model, "--draft", draft, "--prompt", WPROMPT, "-m", "12", "--compare-plain"]
    out = json.loads(run.invoke(main, [*base, "--json"]).stdout)
    assert out["token_ids"] == reference(tiny_pair, WPROMPT, 12)[1]
    plain = out["plain"]
    assert plain["same_tokens"] and plain["greedy"] and plain["generated_tokens"] == 12
    assert plain["stats"]["plain_steps"] == plain["stats"]["cycles"] and plain["stats"]["accepted_drafts"] == 0
    res = run.invoke(main, base)
    assert res.exit_code == 0, res.output
    err = res.stderr.splitlines()
    assert err[0].startswith("[dflash] prompt ") and "decoding the same prompt plainly" in err[1]
    assert "x plain decoding (measured)" in err[2] and "the same tokens: yes" in err[2], err


def test_dflash_generate_flags(tiny_pair):  # noqa: F811
    from dflash.engine.cli import main

    model, draft = tiny_pair
    run = CliRunner(env={"DFLASH_BLAS": "none"})
    base = ["generate", "--model", model, "--draft", draft, "--prompt", PROMPT, "-m", "16", "--json",
            "--verify-window", "full"]
    res = run.invoke(main, [*base, "--temperature", "0.8", "--top-p", "0.95", "--top-k", "50", "--seed", "11"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, **SAMPLED, **FULL)[1]
    assert out["sampling"] == {**SAMPLED, "min_p": 0.0, "min_tokens_to_keep": 1}
    out = json.loads(run.invoke(main, [*base, "--temperature", "1.5", "--min-p", "0.2", "--seed", "11"]).output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, temperature=1.5, min_p=0.2, seed=11, **FULL)[1]
    assert out["sampling"]["min_p"] == 0.2
    out = json.loads(run.invoke(main, [*base, "--temperature", "1.5", "--min-p", "1", "--min-tokens-to-keep", "5",
                                       "--seed", "11"]).output)
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, **KEEP, **FULL)[1]
    assert out["sampling"] == KEEP
    flags = ["--logit-bias", "5=3", "--repetition-penalty", "1.8", "--repetition-context-size", "30",
             "--frequency-penalty", "0.6"]
    out = json.loads(run.invoke(main, [*base[:-2], *flags]).output)  # the default window, greedy
    assert out["token_ids"] == reference(tiny_pair, PROMPT, 16, **PROCS)[1]
    for flags, word in [(["--logit-bias", "7"], "ID=BIAS"), (["--frequency-context-size", "0"], "--frequency-context-size"),
                        (["--repetition-penalty", "0"], "repetition_penalty must be")]:
        res = run.invoke(main, [*base, *flags])
        assert res.exit_code != 0 and word in res.output, (flags, res.output)
    drawn = json.loads(run.invoke(main, [*base, "--temperature", "0.8"]).output)  # no seed: one is drawn
    assert isinstance(drawn["sampling"]["seed"], int)
    again = json.loads(run.invoke(main, [*base, "--temperature", "0.8", "--seed", str(drawn["sampling"]["seed"])]).output)
    assert again["token_ids"] == drawn["token_ids"]
    greedy = json.loads(run.invoke(main, base).output)
    assert greedy["token_ids"] == reference(tiny_pair, PROMPT, 16)[1]
    assert greedy["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "min_p": 0.0,
                                  "min_tokens_to_keep": 1}
    for flags, word in [(["--temperature", "-0.1"], "--temperature"), (["--temperature", "nan"], "finite"),
                        (["--top-p", "0"], "--top-p"), (["--top-k", "-1"], "--top-k"),
                        (["--seed", str(1 << 64)], "--seed"), (["--min-p", "-0.1"], "--min-p"),
                        (["--min-p", "nan"], "finite"), (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
                        (["--min-tokens-to-keep", "x"], "--min-tokens-to-keep")]:
        res = run.invoke(main, [*base, *flags])
        assert res.exit_code == 2 and word in res.output, (flags, res.output)
