"""The tiered prefix cache and sparse prefill through the daemon: real supervisor, worker and
cache process, real ipc sockets and diskcache, tiny real models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from daemon_fixtures import PROMPTS, running, reference, tiny_pair, wait_until  # noqa: F401

from dflash.client import BadRequestError, CacheUnavailableError, NotFoundError

LONG = PROMPTS[3] + " " + " ".join(PROMPTS[4:8])  # a few dozen tokens: several snapshot boundaries


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, cache_every=16)


@pytest.fixture
def client(daemon):
    with daemon.client(timeout=30) as c:
        yield c



def _sparse_reference(tiny_pair, ids, positions, max_tokens):  # noqa: F811
    from dflash.engine.generate import Finished, stream_dflash_generate

    reference(tiny_pair, ids, 1)  # loads and keeps the pair
    from daemon_fixtures import _REF_PAIR

    pair = _REF_PAIR[tiny_pair]
    for ev in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, max_tokens,
                                     prompt_tokens_override=[ids[p] for p in positions],
                                     prompt_token_positions=positions):
        if isinstance(ev, Finished):
            return ev.token_ids
    raise AssertionError("no Finished event")


def _child_pid(daemon, name: str) -> int:
    state = json.loads((daemon.dir / "run" / "supervisor.json").read_text())
    return state["children"][name]["pid"]


def test_repeat_hits_l1_then_l2_after_worker_kill9(daemon, client, tiny_pair):  # noqa: F811
    _, ref = reference(tiny_pair, LONG, 16)
    cold = client.generate(LONG, max_tokens=16)
    assert cold.token_ids == ref and cold.stats["cached_prompt_tokens"] == 0
    warm = client.generate(LONG, max_tokens=16)
    assert warm.token_ids == ref
    assert warm.stats["cached_prompt_tokens"] == warm.stats["prompt_tokens"]  # whole-prompt L1 hit
    st = client.stats()["cache"]
    assert st["l2_up"] and st["l1"]["hits"] >= 1 and st["hit_tokens"] >= warm.stats["prompt_tokens"]
    wait_until(lambda: client.stats()["cache"]["l2"]["entries"] >= 2, what="write-through to L2")

    pid = daemon.worker_pid()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: daemon.wait_ready()["pid"] != pid, timeout=60, what="worker restart")
    again = client.generate(LONG, max_tokens=16)  # fresh worker: empty L1, the hit comes from L2
    assert again.token_ids == ref and again.stats["cached_prompt_tokens"] > 0
    st = client.stats()["cache"]
    assert st["l2"]["hits"] == 1 and st["l1"]["hits"] == 0

    # a longer prompt sharing the prefix resumes at the last snapshot mark it shares (the
    # restarted worker does not know the earlier prompt's end off the marks; cache/tiers.py
    # snapshot_marks: every 16 here, sparser past 128 tokens)
    from daemon_fixtures import _REF_PAIR

    from dflash.cache.tiers import snapshot_marks
    from dflash.engine.prompting import build_prompt

    prompt_ids = build_prompt(_REF_PAIR[tiny_pair].tokenizer, LONG)
    longer = prompt_ids + prompt_ids[5:20]
    res = client.generate(longer, max_tokens=8)
    assert res.token_ids == reference(tiny_pair, longer, 8)[1]
    n = len(prompt_ids)
    assert res.stats["cached_prompt_tokens"] == max(m for m in [*snapshot_marks(n, 16), n] if m % 16 == 0) > 0


def test_cache_policies(client, tiny_pair):  # noqa: F811
    _, ref = reference(tiny_pair, PROMPTS[8], 8)
    assert client.generate(PROMPTS[8], max_tokens=8, cache="bypass").stats["cached_prompt_tokens"] == 0
    assert client.generate(PROMPTS[8], max_tokens=8, cache="bypass").stats["cached_prompt_tokens"] == 0
    fresh = client.generate(PROMPTS[8], max_tokens=8, cache="refresh")  # stores, never restores
    assert fresh.token_ids == ref and fresh.stats["cached_prompt_tokens"] == 0
    hit = client.generate(PROMPTS[8], max_tokens=8)
    assert hit.token_ids == ref and hit.stats["cached_prompt_tokens"] == hit.stats["prompt_tokens"]
    with pytest.raises(BadRequestError, match="cache must be one of"):
        client.generate(PROMPTS[8], max_tokens=8, cache="sometimes")


def test_position_lists_across_apps_and_sparse_submit(daemon, tiny_pair):  # noqa: F811
    ids = list(range(5, 69))
    positions = list(range(0, 16)) + list(range(32, 64))
    a, b = daemon.client(timeout=30), daemon.client(timeout=30)
    assert a.put_positions("doc-1", positions) == {"name": "doc-1", "stored": len(positions)}
    assert b.get_positions("doc-1") == positions
    cli = subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint,
                          "positions", "list"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "doc-1" in json.loads(cli.stdout), cli.stderr

    by_name = b.generate(ids, max_tokens=12, positions_name="doc-1")
    explicit = a.generate(ids, max_tokens=12, positions=positions)
    assert by_name.token_ids == explicit.token_ids == _sparse_reference(tiny_pair, ids, positions, 12)
    assert by_name.stats["prompt_tokens"] == len(positions) and by_name.stats["cached_prompt_tokens"] == 0
    assert not by_name.stats["warnings"]
    scattered = a.generate(ids, max_tokens=4, positions=list(range(0, 64, 2)))
    assert any("scattered" in w for w in scattered.stats["warnings"])

    assert "doc-1" in b.list_positions() and a.delete_positions("doc-1") is True
    assert a.delete_positions("doc-1") is False and "doc-1" not in b.list_positions()
    with pytest.raises(NotFoundError):
        b.get_positions("doc-1")
    with pytest.raises(NotFoundError):
        b.generate(ids, max_tokens=4, positions_name="doc-1")
    a.close()
    b.close()


def test_bad_sparse_requests_get_clear_errors(client, tiny_pair):  # noqa: F811
    ids = list(range(5, 40))
    cases = [
        (dict(positions=[3, 2, 5]), "bad_positions", "strictly increasing"),
        (dict(positions=[]), "bad_positions", "empty"),
        (dict(positions=[0, 1, 35]), "bad_positions", "outside the prompt"),
        (dict(positions=[-1, 0]), "bad_positions", ">= 0"),
        (dict(positions=[0, 1], cache="use"), "sparse_with_cache", "cannot use the prefix cache"),
        (dict(positions_name="x", cache="refresh"), "sparse_with_cache", "bypass"),
        (dict(positions=[0], positions_name="x"), "bad_request", "not both"),
    ]
    for kw, code, text in cases:
        with pytest.raises(BadRequestError, match=text) as e:
            client.generate(ids, max_tokens=4, **kw)
        assert e.value.code == code, kw
    with pytest.raises(BadRequestError, match="outside the prompt") as e:  # known only after templating
        client.generate("hi", max_tokens=4, positions=[0, 5000])
    assert e.value.code == "bad_positions"
    with pytest.raises(BadRequestError) as e:
        client.put_positions("bad", [5, 1])
    assert e.value.code == "bad_positions"
    ok = client.generate(ids, max_tokens=4, positions=[0, 1, 2], cache="bypass")  # still serving
    assert len(ok.token_ids) == 4


def test_cache_process_down_then_back(daemon, client, tiny_pair):  # noqa: F811
    pid = _child_pid(daemon, "cache")
    os.kill(pid, signal.SIGSTOP)  # hung: every request to it times out
    t0 = time.monotonic()
    _, ref = reference(tiny_pair, PROMPTS[9], 8)
    cold = client.generate(PROMPTS[9], max_tokens=8)  # L1 only: still answers, still lossless
    warm = client.generate(PROMPTS[9], max_tokens=8)
    assert cold.token_ids == warm.token_ids == ref and warm.stats["cached_prompt_tokens"] > 0
    assert time.monotonic() - t0 < 10
    with pytest.raises(CacheUnavailableError):
        client.list_positions()
    assert client.stats()["l2_cache"] == "down"
    os.kill(pid, signal.SIGKILL)  # now dead: the supervisor restarts it
    wait_until(lambda: client.stats()["cache"]["l2_up"], timeout=20, what="cache process restart")
    client.put_positions("back", [0, 1, 2])
    assert client.get_positions("back") == [0, 1, 2]
    st = json.loads((daemon.dir / "run" / "supervisor.json").read_text())
    assert st["children"]["cache"]["restarts"] == 1
