"""The gateway's soak audit (scripts/gateway_soak.py), run small: a real daemon and a real
`dflash serve`, every kind of request in the mix (the `openai` client, clients that leave at each
point, malformed requests and raw bytes, bursts past the queue, fuzzed bodies), and nothing
unexpected: every answer the right status and shape, no 5xx, no job left running or held after a
client left, every job whose client left cancelled, no job run to its end unseen, nothing at
ERROR in the gateway's log, a clean exit on SIGTERM. Counts only: nothing here asserts on time or
memory (the verdict's slopes need a longer run: benchmark/results/gateway-soak-s33-cpu.json)."""

from __future__ import annotations

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def gsoak():
    return load_script("gateway_soak")


def test_every_kind_comes_first_then_the_weighted_draw(gsoak):
    load = gsoak.Load(None, seed=1, max_tokens=8, long_tokens=100, vocab=256, eos=[2])
    picked = [load.pick()[0] for _ in range(len(gsoak.MIX) + 50)]
    assert picked[:len(gsoak.MIX)] == list(gsoak.MIX)  # a short run sees every kind
    assert set(picked[len(gsoak.MIX):]) <= set(gsoak.MIX)
    assert load.ban_eos == {"2": -100}  # a leaving client's job can only end by a cancel


def test_verdict_tells_growth_from_a_step(gsoak):
    def series(fds):
        return [{"requests": 100 * i, "procs": {"gateway": {"fds": v, "threads": 6, "rss_kb": 1000,
                                                             "fd_kinds": {"socket": v - 10}}},
                 "gateway_tcp": {"established": 1, "time_wait": 50 * i}, "tables": {"watchers": 0}, "cache": {},
                 "l1": {}, "jobs_listed": 0, "daemon": {"held": 0}} for i, v in enumerate(fds)]

    assert gsoak.verdict(series([30, 34, 34, 34, 34, 34, 34, 34]), warmup=100)["leak_free"]
    assert gsoak.verdict(series([30, 30, 30, 30, 37, 37, 37, 37]), warmup=100)["leak_free"]  # one step
    v = gsoak.verdict(series([30, 31, 32, 33, 34, 35, 36, 37]), warmup=100)
    assert v["grows"] == ["gateway.fd.socket", "gateway.fds"]
    assert v["metrics"]["gateway.fds"]["per_100_requests"] == pytest.approx(1.0)
    assert not v["metrics"]["gateway.tcp_open"]["grows"]  # closed (TIME_WAIT) connections are not counted


def test_a_small_gateway_soak_finds_nothing(gsoak, tmp_path):
    out = tmp_path / "gateway-soak.json"
    gsoak.main(["--requests", "60", "--every", "30", "--threads", "3", "--max-tokens", "8", "--seed", "3",
                "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["unexpected_errors"] == [] and r["unexpected_count"] == 0
    assert sum(r["outcomes"].values()) == 60
    assert {k.split(":")[0] for k in r["outcomes"]} == set(gsoak.MIX)  # every kind answered as it should
    assert not any("UNEXPECTED" in k for k in r["outcomes"])
    # clients that left: every job known by id cancelled, none left running or held, none ran on unseen
    d = r["disconnects"]
    assert d["orphans"] == [] and d["jobs_done_unseen"] == 0
    assert d["jobs_checked"] and all(k.endswith(":cancelled") for k in d["jobs_checked"]), d["jobs_checked"]
    for s in r["series"]:
        assert s["jobs_listed"] == 0 and s["daemon"]["held"] == 0 and s["daemon"]["running"] is None
        assert not any(int(code) >= 500 for code in s["gateway_metrics"]["by_status"])
    assert r["series"][-1]["gateway_metrics"]["by_status"].get("499")  # the leaving clients, counted
    assert r["gateway_log"]["errors"] == 0, r["gateway_log"]["lines"]
    assert r["gateway_exit"] == 0
