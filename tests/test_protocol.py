"""Wire structs, the codec, configuration precedence and the accelerator plan (no processes)."""

from __future__ import annotations

import dataclasses
import os
import stat

import msgpack
import pytest

from dflash.daemon import codec, paths
from dflash.engine import accel
from dflash.daemon import protocol as P
from dflash.daemon.config import DaemonConfig, load_config


def test_every_struct_round_trips_with_version():
    for cls in list(P.REQUESTS.values()):
        msg = cls(rid=7, **({"job_id": "j-1"} if cls in (P.Cancel, P.JobStatus) else {}))  # they need an id
        m = codec.decode_map(codec.encode(msg))
        assert m["v"] == P.VERSION and m["op"] == cls.op
        assert P.parse_request(m) == msg
    for cls in list(P.REPLIES.values()):
        msg = cls(rid=9)
        m = codec.decode_map(codec.encode(msg))
        assert m["v"] == P.VERSION and m["type"] == cls.type
        assert P.parse_reply(m) == msg


def test_submit_fields_survive_the_wire():
    sub = P.Submit(rid=3, job_id="j-1", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                   stop=["\n"], priority=2, stream=False, timeout_s=1.5)
    assert codec.decode_request(codec.encode(sub)) == sub
    wire = P.to_map(sub)
    assert list(wire)[:3] == ["v", "op", "rid"]  # field order is the schema


def test_no_pickle_and_no_binary_surprises():
    frame = codec.encode(P.Delta(text="é", token_ids=[1, 2], from_draft=[True, False]))
    assert b"pickle" not in frame and msgpack.unpackb(frame)["text"] == "é"


V = P.VERSION


@pytest.mark.parametrize(
    "frame,code",
    [
        (b"\xc1", P.BAD_FRAME),  # never-used msgpack byte
        (msgpack.packb([1, 2]), P.BAD_FRAME),
        (msgpack.packb({"v": V + 1, "op": "stats"}), P.BAD_VERSION),
        (msgpack.packb({"v": 1, "op": "stats"}), P.BAD_VERSION),  # older versions
        (msgpack.packb({"v": 2, "op": "stats"}), P.BAD_VERSION),
        (msgpack.packb({"op": "stats"}), P.BAD_VERSION),
        (msgpack.packb({"v": V, "op": "nope"}), P.UNKNOWN_OP),
        (msgpack.packb({"v": V, "op": "submit", "max_tokens": "9"}), P.BAD_REQUEST),
        (msgpack.packb({"v": V, "op": "submit", "stream": 1}), P.BAD_REQUEST),  # bool is not int
        (msgpack.packb({"v": V, "op": "submit", "token_ids": [1, True]}), P.BAD_REQUEST),
        (msgpack.packb({"v": V, "op": "stats", "extra": 1}), P.BAD_REQUEST),
        (msgpack.packb({"v": V, "op": "submit", "temperature": "hot"}), P.BAD_REQUEST),
        (msgpack.packb({"v": V, "op": "submit", "top_k": 2.5}), P.BAD_REQUEST),
        (msgpack.packb({1: 1}), P.BAD_FRAME),  # non-string keys
        (b"\x00" * 2048, P.TOO_LARGE),
    ],
)
def test_malformed_requests_raise_protocol_errors(frame, code):
    with pytest.raises(P.ProtocolError) as e:
        codec.decode_request(frame, max_bytes=1024)
    assert e.value.code == code


def test_peek_rid_names_the_request_even_when_invalid():
    assert codec.peek_rid(msgpack.packb({"v": V, "op": "x", "rid": 42})) == 42
    assert codec.peek_rid(b"\xc1garbage") == 0


def test_config_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('model = "/file/model"\nmax_queue = 5\nheartbeat_s = 0.9\n')
    env = {"DFLASH_MAX_QUEUE": "7", "DFLASH_HEARTBEAT_S": "0.2"}
    cfg = load_config(f, overrides={"max_queue": 9, "model": None}, env=env)
    assert cfg.model == "/file/model"  # file (flag None = not given)
    assert cfg.heartbeat_s == 0.2  # env beats file
    assert cfg.max_queue == 9  # flag beats env
    assert load_config(f, env={}).max_queue == 5  # file beats defaults
    with pytest.raises(ValueError):
        load_config(f, env={"DFLASH_MAX_QUEUE": "lots"})
    bad = tmp_path / "bad.toml"
    bad.write_text("mdoel = 'typo'\n")
    with pytest.raises(ValueError, match="unknown setting"):
        load_config(bad, env={})
    assert DaemonConfig.from_json(cfg.to_json()) == cfg


def test_endpoint_rules():
    DaemonConfig(endpoint="tcp://127.0.0.1:5555").validate()
    DaemonConfig(endpoint="tcp://[::1]:5555").validate()
    with pytest.raises(ValueError, match="CURVE"):
        DaemonConfig(endpoint="tcp://0.0.0.0:5555").validate()
    DaemonConfig(endpoint="tcp://0.0.0.0:5555", curve_server_secret="/k/server.key_secret").validate()
    with pytest.raises(ValueError):
        DaemonConfig(endpoint="http://x").validate()
    assert DaemonConfig(runtime_dir="/r").resolved_endpoint() == "ipc:///r/worker.sock"


def test_private_dir_is_0700_and_repaired(tmp_path):
    d = paths.private_dir(tmp_path / "run")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o755)
    paths.private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_accel_plan_finds_mkl_in_the_env_lib_dir(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    assert accel.find_mkl(tmp_path) is None
    real = lib / "libmkl_rt.so.2.real"
    real.write_bytes(b"")
    (lib / "libmkl_rt.so.2").symlink_to(real)
    assert accel.find_mkl(tmp_path) == real.resolve()
    monkeypatch.setattr(accel.sys, "platform", "linux")
    monkeypatch.setattr(accel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(accel, "cpuinfo", lambda field: "GenuineIntel")  # AMD: one thread (test_accel.py)
    plan = accel.plan("auto", tmp_path, env={})
    assert plan["LD_PRELOAD"] == str(real.resolve()) and plan["MKL_THREADING_LAYER"] == "SEQUENTIAL"
    (lib / "libiomp5.so").write_bytes(b"")  # MKL's OpenMP runtime beside it: threads over every core
    assert accel.plan("auto", tmp_path, env={})["MKL_THREADING_LAYER"] == "INTEL"
    monkeypatch.setattr(accel, "cpuinfo", lambda field: "AuthenticAMD")
    assert accel.plan("auto", tmp_path, env={})["MKL_THREADING_LAYER"] == "SEQUENTIAL"
    monkeypatch.setattr(accel, "cpuinfo", lambda field: "GenuineIntel")
    mine = accel.plan("auto", tmp_path, env={"MKL_THREADING_LAYER": "GNU"})
    assert mine["MKL_THREADING_LAYER"] == "GNU"  # the user's choice wins
    assert accel.plan("auto", tmp_path, env={accel.MARK: "mkl"}) is None  # no re-exec loop
    assert accel.plan("none", tmp_path, env={}) is None
    with pytest.raises(RuntimeError):
        accel.plan("mkl", tmp_path / "nowhere", env={})


def test_reply_structs_have_defaults_for_every_field():
    # appended fields must have defaults so older peers can still build the struct
    for cls in list(P.REQUESTS.values()) + list(P.REPLIES.values()):
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


# ----------------------------------------------------------------------------- version 2: sampling

# The submit fields of version 1, in their wire order: versions 2 and 3 only append.
V1_SUBMIT = ["rid", "job_id", "text", "messages", "token_ids", "system", "raw", "max_tokens", "stop", "priority",
             "stream", "timeout_s", "cache", "positions", "positions_name", "template_args"]


def test_sampling_fields_are_appended_and_travel():
    names = [f.name for f in dataclasses.fields(P.Submit)]
    assert names[:len(V1_SUBMIT) + 4] == V1_SUBMIT + ["temperature", "top_p", "top_k", "seed"]
    sub = P.Submit(rid=1, text="hi", temperature=0.7, top_p=0.9, top_k=40, seed=(1 << 64) - 1)
    wire = P.to_map(sub)
    assert list(wire)[2 + len(V1_SUBMIT):][:4] == ["temperature", "top_p", "top_k", "seed"]  # after v, op
    assert codec.decode_request(codec.encode(sub)) == sub
    assert codec.decode_request(codec.encode(P.Submit(text="x", temperature=1))).temperature == 1  # int ok


def test_sampling_rules():
    P.check_sampling()  # all unset
    P.check_sampling(0, 1, 0, 0)
    P.check_sampling(2.5, 0.01, 50, (1 << 64) - 1)
    for kw, param in [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                      ({"temperature": float("inf")}, "temperature"), ({"top_p": 0}, "top_p"),
                      ({"top_p": 1.01}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": True}, "top_k"),
                      ({"seed": -1}, "seed"), ({"seed": 1 << 64}, "seed"), ({"seed": 1.0}, "seed"),
                      ({"min_p": -0.5}, "min_p"), ({"min_p": 2}, "min_p"), ({"min_p": True}, "min_p"),
                      ({"min_tokens_to_keep": 0}, "min_tokens_to_keep"),
                      ({"min_tokens_to_keep": 2.0}, "min_tokens_to_keep"),
                      ({"min_tokens_to_keep": True}, "min_tokens_to_keep")]:
        with pytest.raises(P.ProtocolError) as e:
            P.check_sampling(**kw)
        assert (e.value.code, e.value.param) == (P.BAD_SAMPLING, param) and param in e.value.message


# ----------------------------------------------------------------------------- version 3: verify window


def test_verify_window_is_appended_and_travels():
    names = [f.name for f in dataclasses.fields(P.Submit)]
    assert names[:len(V1_SUBMIT) + 5] == V1_SUBMIT + ["temperature", "top_p", "top_k", "seed", "verify_window"]
    for window in ("auto", "full", 1, 16, None):
        sub = P.Submit(rid=2, text="hi", verify_window=window)
        P.check_submit(sub)
        assert list(P.to_map(sub))[len(V1_SUBMIT) + 6] == "verify_window"  # after v, op
        assert codec.decode_request(codec.encode(sub)) == sub


# ----------------------------------------------------------------------------- version 4: min_p


def test_min_p_is_appended_and_travels():
    names = [f.name for f in dataclasses.fields(P.Submit)]
    assert names[:len(V1_SUBMIT) + 6 + len(P.PROCESSOR_FIELDS)] == V1_SUBMIT + [
        "temperature", "top_p", "top_k", "seed", "verify_window", "min_p", *P.PROCESSOR_FIELDS]
    for value in (None, 0, 0.05, 1.0):
        sub = P.Submit(rid=4, text="hi", min_p=value)
        P.check_submit(sub)
        assert list(P.to_map(sub))[len(V1_SUBMIT) + 7] == "min_p"
        assert codec.decode_request(codec.encode(sub)) == sub
    for bad in (-0.01, 1.5, float("nan"), float("inf")):
        with pytest.raises(P.ProtocolError) as e:
            P.check_submit(P.Submit(text="hi", min_p=bad))
        assert (e.value.code, e.value.param) == (P.BAD_SAMPLING, "min_p") and "min_p must be in [0, 1]" in e.value.message
    with pytest.raises(P.ProtocolError) as e:  # the wrong wire type: the type check, naming the field
        P.parse_request({"v": P.VERSION, "op": "submit", "text": "hi", "min_p": "0.1"})
    assert (e.value.code, e.value.param) == (P.BAD_REQUEST, "min_p")
    # a version-3 peer's error keeps `param` (it was appended in 3); versions 1 and 2 never had it
    assert list(P.to_map(P.Error(rid=1, param="x"), version=3))[-1] == "param"
    assert "param" not in P.to_map(P.Error(rid=1, param="x"), version=2)


# ----------------------------------------------------------------------------- version 5: min_tokens_to_keep


def test_min_tokens_to_keep_is_appended_and_travels():
    """Version 5 appends min_tokens_to_keep to submit (a version-4 worker would refuse the field)."""
    assert P.VERSION == 5 and P.OLDER_VERSIONS == (1, 2, 3, 4)
    names = [f.name for f in dataclasses.fields(P.Submit)]
    assert names == V1_SUBMIT + ["temperature", "top_p", "top_k", "seed", "verify_window", "min_p",
                                 *P.PROCESSOR_FIELDS, "min_tokens_to_keep"]
    assert P.SAMPLING_FIELDS[-1] == "min_tokens_to_keep"
    for value in (None, 1, 3, (1 << 64) - 1):
        sub = P.Submit(rid=6, text="hi", min_p=0.1, min_tokens_to_keep=value)
        P.check_submit(sub)
        assert list(P.to_map(sub))[-1] == "min_tokens_to_keep"
        assert codec.decode_request(codec.encode(sub)) == sub
    for bad in (0, -2, 1 << 64):
        with pytest.raises(P.ProtocolError) as e:
            P.check_submit(P.Submit(text="hi", min_tokens_to_keep=bad))
        assert (e.value.code, e.value.param) == (P.BAD_SAMPLING, "min_tokens_to_keep")
        assert "min_tokens_to_keep must be an integer >= 1" in e.value.message
    for bad in (2.0, "3", True):  # the wrong wire type: the type check, naming the field
        with pytest.raises(P.ProtocolError) as e:
            P.parse_request({"v": P.VERSION, "op": "submit", "text": "hi", "min_tokens_to_keep": bad})
        assert (e.value.code, e.value.param) == (P.BAD_REQUEST, "min_tokens_to_keep")
    # a version-4 peer gets its errors in its own layout (param included: appended in 3)
    assert list(P.to_map(P.Error(rid=1, param="x"), version=4))[-1] == "param"
    with pytest.raises(P.ProtocolError) as e:
        P.parse_request({"v": 4, "op": "submit", "text": "hi", "min_p": 0.1})
    assert e.value.code == P.BAD_VERSION and e.value.peer_version == 4


def test_processors_travel_and_are_checked():
    sub = P.Submit(rid=5, text="hi", logit_bias={"7": -100.0, "12": 2}, repetition_penalty=1.3,
                   repetition_context_size=64, presence_penalty=-0.5, presence_context_size=1,
                   frequency_penalty=0.25, frequency_context_size=20)
    P.check_submit(sub)
    assert codec.decode_request(codec.encode(sub)) == sub
    for kw, param in [({"logit_bias": {"-1": 1.0}}, "logit_bias"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
                      ({"logit_bias": {"5": float("nan")}}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
                      ({"logit_bias": {"1" * 21: 1.0}}, "logit_bias"),
                      ({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"repetition_penalty": float("inf")}, "repetition_penalty"),
                      ({"presence_penalty": float("nan")}, "presence_penalty"),
                      ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
                      ({"repetition_context_size": 0}, "repetition_context_size"),
                      ({"presence_context_size": -5}, "presence_context_size")]:
        with pytest.raises(P.ProtocolError) as e:
            P.check_submit(P.Submit(text="hi", **kw))
        assert (e.value.code, e.value.param) == (P.BAD_SAMPLING, param) and param in e.value.message, kw
    for bad in ({"logit_bias": [1, 2]}, {"repetition_penalty": "1.1"}, {"frequency_context_size": 2.5}):
        with pytest.raises(P.ProtocolError) as e:  # the wrong wire type: bad_request naming the field
            P.parse_request({"v": P.VERSION, "op": "submit", "text": "hi", **bad})
        assert (e.value.code, e.value.param) == (P.BAD_REQUEST, next(iter(bad)))
    with pytest.raises(P.ProtocolError) as e:  # int map keys cannot even be decoded (strict_map_key)
        codec.decode_request(msgpack.packb({"v": P.VERSION, "op": "submit", "text": "hi", "logit_bias": {5: 1.0}}))
    assert e.value.code == P.BAD_FRAME


def test_verify_window_rules():
    for bad in (0, -1, "8", "AUTO", "", 2.0, True, [4]):
        assert P.verify_window_problem(bad) is not None, bad
        with pytest.raises(P.ProtocolError) as e:
            P.check_submit(P.Submit(text="hi", verify_window=bad))
        assert (e.value.code, e.value.param) == (P.BAD_REQUEST, "verify_window")
        assert "verify_window must be" in e.value.message
    # a decoded request of the wrong type is refused by the type check, naming the field
    with pytest.raises(P.ProtocolError) as e:
        P.parse_request({"v": P.VERSION, "op": "submit", "text": "hi", "verify_window": 2.5})
    assert e.value.code == P.BAD_REQUEST and "verify_window" in e.value.message


def test_version_errors_name_both_versions():
    with pytest.raises(P.ProtocolError) as e:
        P.parse_request({"v": 1, "op": "submit", "text": "hi"})
    assert e.value.code == P.BAD_VERSION and e.value.peer_version == 1
    assert "version 1" in e.value.message and f"version {P.VERSION}" in e.value.message
    with pytest.raises(P.ProtocolError) as e:
        P.parse_reply({"v": 1, "type": "error", "code": "bad_version", "message": "old"})
    assert e.value.code == P.BAD_VERSION and "reply is version 1" in e.value.message
    # An error to an old peer can be written in its version (the layout is unchanged since 1).
    old = P.to_map(P.Error(rid=3, code=P.BAD_VERSION, message="m"), version=1)
    assert old["v"] == 1 and list(old) == ["v", "type", "rid", "code", "message", "job_id"]
    # Stored results of the previous version are read as this version's.
    done = P.to_map(P.Done(job_id="j", text="t"), version=1)
    assert P.parse_reply(P.current_result(done)) == P.Done(job_id="j", text="t")
    assert P.current_result({"v": 7, "type": "done"})["v"] == 7


def test_generation_defaults_in_config(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('model = "/m"\nverify_window = "full"\n[generation]\ntemperature = 0.7\ntop_p = 0.9\ntop_k = 40\nseed = 5\n')
    cfg = load_config(f, env={})
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed, cfg.verify_window) == (0.7, 0.9, 40, 5, "full")
    cfg.validate()
    assert DaemonConfig.from_json(cfg.to_json()) == cfg
    assert load_config(f, env={"DFLASH_TEMPERATURE": "0", "DFLASH_SEED": "9"}).seed == 9
    d = tmp_path / "d.toml"  # a [daemon] table with [generation] beside it
    d.write_text('[daemon]\nmodel = "/m"\n[generation]\ntop_k = 3\n')
    assert load_config(d, env={}).top_k == 3
    assert DaemonConfig().temperature == 0.0 and DaemonConfig().seed is None  # greedy by default
    m = tmp_path / "m.toml"  # min_p (version 4) is a [generation] default too
    m.write_text("[generation]\nmin_p = 0.1\nrepetition_penalty = 1.2\nfrequency_context_size = 40\n")
    got = load_config(m, env={})
    assert (got.min_p, got.repetition_penalty, got.frequency_context_size) == (0.1, 1.2, 40)
    assert DaemonConfig().min_p == 0.0 and DaemonConfig().repetition_penalty == 1.0  # off by default
    assert load_config(None, env={"DFLASH_MIN_P": "0.05"}).min_p == 0.05
    k = tmp_path / "k.toml"  # min_tokens_to_keep (version 5) too: mlx-lm's default 1 unless set
    k.write_text("[generation]\nmin_p = 0.1\nmin_tokens_to_keep = 3\n")
    assert load_config(k, env={}).min_tokens_to_keep == 3 and DaemonConfig().min_tokens_to_keep == 1
    assert load_config(None, env={"DFLASH_MIN_TOKENS_TO_KEEP": "4"}).min_tokens_to_keep == 4
    with pytest.raises(ValueError, match=r"\[generation\] min_tokens_to_keep must be an integer >= 1"):
        dataclasses.replace(DaemonConfig(), min_tokens_to_keep=0).validate()
    bad = tmp_path / "bad.toml"
    bad.write_text("[generation]\ntypical_p = 0.9\n")
    with pytest.raises(ValueError, match=r"\[generation\] takes only"):
        load_config(bad, env={})
    for setting in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"verify_window": "wide"},
                    {"min_p": 1.5}, {"min_p": -0.1}, {"repetition_penalty": 0.0}, {"presence_context_size": 0}):
        with pytest.raises(ValueError):
            dataclasses.replace(DaemonConfig(), **setting).validate()
