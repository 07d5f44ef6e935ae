"""Thousands of malformed frames at a live worker: each one answered with an error, the worker
stays up (same pid) and still generates correctly afterwards."""

from __future__ import annotations

import random

import msgpack
import zmq
from daemon_fixtures import PROMPTS, make_daemon, reference, tiny_pair  # noqa: F401

from dflash.daemon import codec
from dflash.daemon import protocol as P

POOL = [None, 0, -1, 7, 1.5, "", "s", b"\x00bin", [], [1, "a"], [{"role": 1}], {}, {"a": 1}, True, False, 2**63]


def _valid_submit() -> dict:
    return P.to_map(P.Submit(rid=1, text="hello", max_tokens=4))


def _invalid_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """Each entry is one message (a list of frames) that must be refused."""
    hints = {name: tp for name, tp in __import__("typing").get_type_hints(P.Submit).items()}
    out: list[list[bytes]] = []
    while len(out) < n:
        kind = rng.randrange(12)
        if kind == 0:  # random bytes
            out.append([bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))])
        elif kind == 1:  # a wrong type in one field
            m = _valid_submit()
            name = rng.choice(list(hints))
            value = rng.choice(POOL)
            if P._matches(value, hints[name]):
                continue
            m[name] = value
            out.append([msgpack.packb(m)])
        elif kind == 2:  # unknown op
            out.append([msgpack.packb({"v": P.VERSION, "op": rng.choice(["", "run", "SUBMIT", "rm -rf", 5])})])
        elif kind == 3:  # missing prompt / missing version / missing op
            m = _valid_submit()
            del m[rng.choice(["text", "v", "op"])]
            out.append([msgpack.packb(m)])
        elif kind == 4:  # huge or zero max_tokens, bad priority, bad timeout, sampling out of range
            m = _valid_submit()
            k, v = rng.choice([("max_tokens", 10**12), ("max_tokens", 0), ("priority", 10**9), ("timeout_s", -1.0),
                               ("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("seed", -1)])
            m[k] = v
            out.append([msgpack.packb(m)])
        elif kind == 5:  # empty prompts
            m = _valid_submit()
            m.update(rng.choice([{"text": ""}, {"text": "  \n"}, {"text": None, "token_ids": []},
                                 {"text": None, "messages": []}, {"text": None, "messages": [{"role": "user"}]}]))
            out.append([msgpack.packb(m)])
        elif kind == 6:  # not a map, or non-string keys
            out.append([msgpack.packb(rng.choice([1, "x", [1, 2], None, {1: 2}, {"v": 1, 3: "op"}]))])
        elif kind == 7:  # wrong version
            m = _valid_submit()
            m["v"] = rng.choice([0, 1, P.VERSION + 1, "1", None, 1.0001])  # 1: the previous version
            out.append([msgpack.packb(m)])
        elif kind == 8:  # several frames in one message / empty frame
            out.append(rng.choice([[b"", b""], [msgpack.packb(_valid_submit()), b"x"], [b""]]))
        elif kind == 9:  # unknown extra field, or two prompts at once
            m = _valid_submit()
            m.update(rng.choice([{"evil": 1}, {"token_ids": [1, 2]}, {"job_id": "../../etc/passwd"}]))
            out.append([msgpack.packb(m)])
        elif kind == 10:  # truncated valid message
            b = msgpack.packb(_valid_submit())
            out.append([b[: rng.randrange(1, len(b))]])
        else:  # deep nesting
            out.append([b"\x91" * rng.randrange(100, 5000) + b"\x00"])
    return out


def test_fuzzed_frames_all_answered_daemon_survives(make_daemon, tiny_pair):  # noqa: F811
    d = make_daemon()
    pid = d.worker_pid()
    rng = random.Random(1234)
    messages = _invalid_frames(rng, 3000)
    big = 2 * d.cfg.max_frame_bytes
    messages += [[b"\x00" * (d.cfg.max_frame_bytes + 1)], [msgpack.packb({"v": P.VERSION, "op": "submit", "text": "a" * big})]]
    messages += [[codec.encode(P.Cancel(rid=5, job_id="nope"))], [codec.encode(P.JobStatus(rid=6, job_id=""))]]

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    codes: dict[str, int] = {}
    try:
        for start in range(0, len(messages), 100):  # batches: never overrun our receive queue
            batch = messages[start : start + 100]
            for frames in batch:
                sock.send_multipart(frames)
            for _ in batch:
                assert sock.poll(10_000), f"no reply within 10s (batch at {start})"
                m = codec.decode_map(sock.recv())
                if m.get("v") in P.OLDER_VERSIONS:  # a previous-version message is answered in its version
                    assert (m["type"], m["code"]) == ("error", P.BAD_VERSION), m
                    m = {**m, "v": P.VERSION}
                reply = P.parse_reply(m)
                assert isinstance(reply, P.Error), reply
                codes[reply.code] = codes.get(reply.code, 0) + 1
        assert not sock.poll(300), "more replies than frames"
    finally:
        sock.close(0)
        ctx.term()

    assert sum(codes.values()) == len(messages)
    for code in (P.BAD_FRAME, P.BAD_REQUEST, P.UNKNOWN_OP, P.BAD_VERSION, P.TOO_LARGE, P.NOT_FOUND, P.BAD_SAMPLING):
        assert codes.get(code, 0) > 0, codes
    with d.client(timeout=20) as c:
        st = c.stats()
        assert st["pid"] == pid and st["restarts"] == 0
        assert st["bad_frames"] >= len(messages)
        assert c.generate(PROMPTS[0], max_tokens=8).token_ids == reference(tiny_pair, PROMPTS[0], 8)[1]
