"""DFlashClient: talk to dflashd from any thread of any process (sync; asyncio in aio.py).

Each call opens its own short-lived DEALER socket, so one client object is safe to share between
threads and nothing outlives a call; ZeroMQ reconnects underneath while the worker restarts.
Submits carry a client-made job id, which makes re-sending one (after a lost reply) harmless.
While a job is in flight the worker sends heartbeats; silence longer than `heartbeat_timeout`
raises WorkerGoneError, so a dead worker is noticed within seconds.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import operator
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import zmq
import zmq.auth

from dflash.daemon import codec
from dflash.daemon import protocol as P
from dflash.daemon.config import DaemonConfig, load_config

from . import errors as E

@dataclass
class Result:
    """A finished job: all text and ids, the engine's stats, and why it ended."""

    job_id: str
    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    finish_reason: str

    @classmethod
    def from_done(cls, d: P.Done) -> "Result":
        return cls(d.job_id, d.text, list(d.token_ids), dict(d.stats), d.finish_reason)


@dataclass
class Delta:
    """New text of a streamed job, its token ids and, per id, whether the draft proposed it."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)


def make_submit(
    prompt: Any,
    *,
    system: str | None = None,
    raw: bool = False,
    max_tokens: int = 256,
    stop: str | Sequence[str] = (),
    priority: int = 0,
    stream: bool = True,
    timeout_s: float | None = None,
    job_id: str | None = None,
    cache: str | None = None,
    positions: Sequence[int] | None = None,
    positions_name: str | None = None,
    template_args: dict | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    verify_window: str | int | None = None,
    min_p: float | None = None,
    logit_bias: Mapping[Any, float] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = None,
    presence_penalty: float | None = None,
    presence_context_size: int | None = None,
    frequency_penalty: float | None = None,
    frequency_context_size: int | None = None,
    min_tokens_to_keep: int | None = None,
) -> P.Submit:
    """A Submit from a text prompt (str), a list of chat messages (dicts) or a list of token ids.

    cache: "use" (default), "bypass" or "refresh"; positions / positions_name: sparse prefill of
    those indices of the prompt's token ids (a list given here, or one stored by name).
    temperature (0 = greedy), top_p (1 = off), top_k (0 = off), seed (0..2^64-1), min_p (0 = off),
    min_tokens_to_keep (the tokens min-p always keeps, >= 1; mlx-lm's default 1): sampling, as
    mlx-lm's make_sampler takes them; logit_bias ({token id: bias}), repetition_penalty
    (1 = off), presence_penalty, frequency_penalty (0 = off) and their *_context_size (20): mlx-lm's
    make_logits_processors. None leaves each to the daemon's configured default (greedy unless its config says otherwise).
    verify_window: this job's tokens per verify, "auto", "full" or 1..block size (1 = plain
    decoding, e.g. to compare); None: the daemon's setting. `stop` is one string or a sequence of them. Nothing is sent when a value is refused: a value
    of the wrong type (bytes as a prompt, a bool or float where an int belongs) is a TypeError; a
    value the worker would refuse (a negative token id, a job id outside [A-Za-z0-9_.-], text that
    is not valid Unicode, sampling out of range) is the BadRequestError the worker would answer."""
    sub = P.Submit(system=system, raw=raw, max_tokens=_int(max_tokens, "max_tokens"),
                   stop=[stop] if isinstance(stop, str) else _seq(stop, "stop"), priority=_int(priority, "priority"),
                   stream=stream, timeout_s=_opt_float(timeout_s, "timeout_s"), job_id=job_id or uuid.uuid4().hex,
                   cache=cache, positions=None if positions is None else int_list(positions, "positions"),
                   positions_name=positions_name, template_args=template_args,
                   temperature=_opt_float(temperature, "temperature"), top_p=_opt_float(top_p, "top_p"),
                   top_k=None if top_k is None else _int(top_k, "top_k"),
                   seed=None if seed is None else _int(seed, "seed"), verify_window=verify_window,
                   min_p=_opt_float(min_p, "min_p"), logit_bias=_bias(logit_bias),
                   repetition_penalty=_opt_float(repetition_penalty, "repetition_penalty"),
                   presence_penalty=_opt_float(presence_penalty, "presence_penalty"),
                   frequency_penalty=_opt_float(frequency_penalty, "frequency_penalty"),
                   **{k: None if v is None else _int(v, k) for k, v in (
                       ("min_tokens_to_keep", min_tokens_to_keep),
                       ("repetition_context_size", repetition_context_size),
                       ("presence_context_size", presence_context_size),
                       ("frequency_context_size", frequency_context_size))})
    if isinstance(prompt, str):
        sub.text = prompt
    elif _is_seq(prompt) and prompt and all(isinstance(m, Mapping) for m in prompt):
        sub.messages = [dict(m) for m in prompt]
    elif _is_seq(prompt) and prompt:
        sub.token_ids = int_list(prompt, "prompt token ids")
    elif _is_seq(prompt):
        raise E.BadRequestError(P.BAD_REQUEST, "empty prompt")
    else:
        raise TypeError(f"prompt must be text (str), a list of chat messages (dicts) or a list of token ids "
                        f"(ints), got {type(prompt).__name__}" + (": decode bytes to str first" if _is_bytes(prompt) else ""))
    try:
        P.check_types(sub)
    except P.ProtocolError as e:
        raise TypeError(e.message) from None
    try:  # the worker's own rules, checked here too: a seed of 2**64 cannot even be encoded
        P.check_submit(sub)
        codec.check_encodable(sub)
    except P.ProtocolError as e:
        raise E.BadRequestError(e.code, e.message, param=e.param or "") from None
    return sub


def _is_bytes(v: Any) -> bool:
    return isinstance(v, (bytes, bytearray, memoryview))


def _is_seq(v: Any) -> bool:
    """A list-like of items; str and bytes-likes are sequences of characters/bytes, never of ids."""
    return isinstance(v, Sequence) and not isinstance(v, str) and not _is_bytes(v)


def _int(v: Any, name: str) -> int:
    """An int (numpy ints too); bools and floats are refused rather than silently converted."""
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    return operator.index(v)


def _bias(v: Any) -> dict[str, float] | None:
    """logit_bias as the wire carries it: {"token id": bias} (map keys are strings there); ids may
    be given as ints (numpy ints too) or decimal strings."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise TypeError(f"logit_bias must map token ids to numbers, got {type(v).__name__}")
    out = {}
    for k, x in v.items():
        key = k if isinstance(k, str) else str(_int(k, "logit_bias token id"))
        if key in out:  # {5: 1.0, "5": 2.0}: one value was dropped without a word
            raise E.BadRequestError(P.BAD_SAMPLING, f"logit_bias names token {key} twice", param="logit_bias")
        out[key] = _opt_float(x, f"logit_bias[{key}]")
        if out[key] is None:
            raise TypeError(f"logit_bias[{key}] must be a number, got None")
    return out


def _opt_float(v: Any, name: str) -> float | None:
    """None, or a real number as float; bools and strings are refused."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
    return float(v)


def _seq(v: Any, name: str) -> list:
    if not _is_seq(v):
        raise TypeError(f"{name} must be a list, got {type(v).__name__}")
    return list(v)


def int_list(v: Any, name: str) -> list[int]:
    """A list of ints (token ids, positions) from any sequence of ints; bytes are refused, since
    treating b"hi" as the ids [104, 105] is never what was meant."""
    if _is_bytes(v):
        raise TypeError(f"{name} must be a list of ints, got {type(v).__name__} (text is a str: decode bytes first)")
    items = _seq(v, name)
    try:
        return [x if type(x) is int else _int(x, name) for x in items]
    except TypeError:  # again, slowly, to name the item
        for i, x in enumerate(items):
            _int(x, f"{name}: item {i}")
        raise


def reply_error(e: P.ProtocolError, endpoint: str) -> E.DFlashError:
    """The typed error for a reply that could not be decoded (ProtocolVersionError when the
    worker speaks another protocol version: its message names both)."""
    cls = E.ProtocolVersionError if e.code == P.BAD_VERSION else E.DFlashError
    return cls(e.code, f"bad reply from {endpoint}: {e.message}")


def client_config(endpoint: str | None, config: DaemonConfig | str | None) -> tuple[str, DaemonConfig]:
    if endpoint is not None and not isinstance(endpoint, str):
        raise TypeError(f"endpoint must be a str such as 'ipc:///path/worker.sock', got {type(endpoint).__name__}")
    if endpoint is not None and not endpoint.strip():
        # refused like the CLI's `--endpoint ""`: an empty string (an unset variable passed on)
        # silently meant the default endpoint, so a client could talk to another daemon
        raise ValueError(f"endpoint {endpoint!r} is empty: an endpoint is ipc://PATH or tcp://HOST:PORT "
                         "(None: DFLASH_ENDPOINT, else the config's)")
    cfg = config if isinstance(config, DaemonConfig) else load_config(config)
    return endpoint or os.environ.get("DFLASH_ENDPOINT") or cfg.resolved_endpoint(), cfg


def sendable(frame: bytes, cfg: DaemonConfig) -> None:
    """BadRequestError(too_large) for a frame the worker's socket would drop unanswered (over
    codec.DROP_FACTOR x max_frame_bytes): said at once, not as "no worker answered" after the
    whole timeout spent re-sending it."""
    try:
        codec.check_sendable(frame, cfg.max_frame_bytes)
    except P.ProtocolError as e:
        raise E.BadRequestError(e.code, e.message) from None


# The longest time setting a client takes (one day): ZeroMQ's poll takes whole milliseconds (1e300 s
# overflowed it) and monotonic() + 1e300 no longer moves; a wait without a bound is result(None).
MAX_WAIT_S = 86400.0


def seconds(v: Any, name: str, zero_ok: bool = False) -> float:
    """A time limit as float: a finite number > 0 (>= 0 with `zero_ok`), at most MAX_WAIT_S.
    Checked up front: a negative one made every call fail at once as "no worker answered", a
    str one much later."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__} {v!r}")
    if not -math.inf < v < math.inf or v < 0 or (v == 0 and not zero_ok):  # isfinite(10**400) overflows
        raise ValueError(f"{name} must be a finite number of seconds {'>=' if zero_ok else '>'} 0, got {v!r}")
    if v > MAX_WAIT_S:
        raise ValueError(f"{name} must be at most {MAX_WAIT_S:g} seconds (one day), got {P.shown(v)}")
    return float(v)


def opt_seconds(v: Any, name: str, zero_ok: bool = False) -> float | None:
    return None if v is None else seconds(v, name, zero_ok)


def client_timings(timeout: Any, heartbeat_timeout: Any, retry_interval: Any) -> tuple[float, float, float]:
    """A client's three time settings, checked (both clients take the same)."""
    return (seconds(timeout, "timeout"), seconds(heartbeat_timeout, "heartbeat_timeout"),
            seconds(retry_interval, "retry_interval"))


def connect(sock: zmq.Socket, endpoint: str) -> None:
    """Connect `sock`, or close it and raise the BadRequestError an endpoint ZeroMQ cannot parse
    deserves (it was a bare `ZMQError: Invalid argument` and a socket left open; one that is not
    valid Unicode, e.g. undecodable bytes on a command line, a UnicodeEncodeError)."""
    try:
        sock.connect(endpoint)
    except (zmq.ZMQError, UnicodeEncodeError) as e:
        sock.close(0)
        why = zmq.strerror(e.errno) if isinstance(e, zmq.ZMQError) else "not valid Unicode text"
        raise E.BadRequestError("bad_endpoint", f"cannot connect to {endpoint!r} ({why}): "
                                "an endpoint is ipc://PATH or tcp://HOST:PORT") from None


def encode_request(msg: Any) -> bytes:
    """The frame for a request. A field the wire cannot carry (a job id or a list name that is not
    valid Unicode, an integer beyond 64 bits) is the BadRequestError naming it, as for a submit
    (make_submit), not msgpack's UnicodeEncodeError or OverflowError."""
    try:
        return codec.encode(msg)
    except (UnicodeEncodeError, OverflowError):
        try:
            codec.check_encodable(msg)
        except P.ProtocolError as e:
            raise E.BadRequestError(e.code, e.message, param=e.param or "") from None
        raise


def unavailable(endpoint: str, refused: bool = False) -> E.WorkerUnavailableError:
    """No answer in time; `refused`: the peer at the endpoint refused the ZeroMQ handshake, which
    a dflash worker refuses only to a client without its CURVE keys (anything else there is not
    a dflash worker: another ZeroMQ socket type)."""
    if refused:
        return E.WorkerUnavailableError(
            "unavailable", f"the server at {endpoint} refused this client's ZeroMQ handshake: it is not a "
            "dflash worker, or it wants CURVE keys this client lacks (curve_server_public in the config)")
    return E.WorkerUnavailableError(
        "unavailable", f"no dflash worker answered at {endpoint} (is `dflashd start` running?)")


# A send that would block with fewer than this many frames queued (ZeroMQ's SNDHWM: 1000) means
# the connection is gone: a DEALER has one from connect() on, and ZeroMQ drops it for good only
# when the peer refuses the handshake (another ZeroMQ socket type, missing or other CURVE keys).
# A blocking send then waited forever, past every timeout; now that is said at once.
REFUSED_BELOW = 500


def send_now(sock: zmq.Socket, frame: bytes) -> bool:
    """Send without blocking; False when it would block (see REFUSED_BELOW)."""
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def worker_gone(endpoint: str, heartbeat_timeout: float, job_id: str) -> E.WorkerGoneError:
    return E.WorkerGoneError("worker_gone", f"the worker at {endpoint} stopped answering "
                             f"(no heartbeat for {heartbeat_timeout:g}s)", job_id)


def closed_error(what: str = "this DFlashClient") -> E.ClientClosedError:
    return E.ClientClosedError("closed", f"{what} is closed: make a new client")


LOOK_S = 1.0


def look_timeout(client_timeout: float, left: float | None) -> float:
    """How long one status request of a result() wait may take: the client's timeout, but no
    longer than the caller's time left, and never less than LOOK_S (so timeout=0 still looks)."""
    return client_timeout if left is None else min(client_timeout, max(left, LOOK_S))


def finished(status: P.Status, endpoint: str) -> Result | None:
    """The Result in a status reply (None while the job runs); the job's error is raised."""
    if status.result is None:
        return None
    try:
        reply = P.parse_reply(status.result)
    except P.ProtocolError as e:
        raise reply_error(e, endpoint) from None
    if isinstance(reply, P.Error):
        raise E.from_reply(reply)
    return Result.from_done(reply)


def waited_too_long(job_id: str, timeout: float) -> E.ClientTimeoutError:
    return E.ClientTimeoutError("timeout", f"job {job_id} not finished in {timeout:g}s", job_id)


def setup_curve(sock: zmq.Socket, cfg: DaemonConfig) -> None:
    """CURVE on the client side when the config names the server's public certificate."""
    if not cfg.curve_server_public:
        return
    server_public, _ = zmq.auth.load_certificate(cfg.curve_server_public)
    if cfg.curve_client_secret:
        public, secret = zmq.auth.load_certificate(cfg.curve_client_secret)
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret


def working_on(reply: P.Reply | None, rid: int) -> bool:
    """Whether `reply` is a heartbeat for request `rid`: the worker has it and is still at it
    (a cache_clear waits for the running job's prefill), so stop re-sending and wait on."""
    return isinstance(reply, P.Heartbeat) and reply.rid == rid


def older_worker(e: E.DFlashError, op: str) -> E.DFlashError:
    """An `unknown_op` for an op this client knows, in words: the daemon is an older release."""
    if e.code != P.UNKNOWN_OP:
        return e
    return E.BadRequestError(P.UNKNOWN_OP, f"this daemon does not know {op!r}: it is older than this client; "
                             "restart it after the upgrade (dflashd stop, dflashd start)")


def answers(reply: P.Reply | None, rid: int) -> bool:
    """Whether `reply` answers request `rid`, sent on a socket of its own: a reply with its rid,
    or an error the worker could tie to no rid (a frame too large or too broken to read one
    from), which on that socket can only be this request's. Without the second case a prompt
    over the worker's frame cap was re-sent until the timeout and reported as no worker."""
    if reply is None or isinstance(reply, P.Heartbeat):
        return False
    return reply.rid == rid or (isinstance(reply, P.Error) and reply.rid == 0)


SEND = object()  # exchange_plan's step: send the request's frame now


def exchange_plan(rid: int, end: float, retry_interval: float, heartbeat_timeout: float,
                  beats: bool, endpoint: str) -> Iterator[Any]:
    """One request's exchange rule, without I/O, for the sync and the async client alike.

    Yields SEND (send the frame now) or a number of seconds (wait up to that long for a reply
    and send back what came, or None); returns the answer or raises. The frame is re-sent
    every retry_interval until `end`; with `beats`, once heartbeats for the request come (a
    request the worker answers later: cache_clear), re-sending stops and the wait lasts as
    long as they do. A submit's heartbeats follow its answer."""
    beating = False
    while True:
        if not beating:
            yield SEND
        retry_at = min(end, time.monotonic() + retry_interval)
        while (left := retry_at - time.monotonic()) > 0:
            reply = yield left
            if answers(reply, rid):
                if isinstance(reply, P.Error):
                    raise E.from_reply(reply)
                return reply
            if beats and working_on(reply, rid):
                beating, end = True, time.monotonic() + heartbeat_timeout
                retry_at = end
        if time.monotonic() >= end:
            raise worker_gone(endpoint, heartbeat_timeout, "") if beating else unavailable(endpoint)


class DFlashClient:
    """Sync client. `timeout`: how long to wait for the worker to answer a request (it may be
    starting or restarting); `heartbeat_timeout`: silence that means the worker died mid-job.
    Close it (or use `with DFlashClient() as c:`) when done; later calls raise ClientClosedError."""

    def __init__(self, endpoint: str | None = None, *, config: DaemonConfig | str | None = None,
                 timeout: float = 30.0, heartbeat_timeout: float = 1.5, retry_interval: float = 3.0):
        self.endpoint, self._cfg = client_config(endpoint, config)
        self.timeout, self.heartbeat_timeout, self.retry_interval = client_timings(
            timeout, heartbeat_timeout, retry_interval)
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._pid = 0
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    def _context(self) -> zmq.Context:
        with self._lock:
            if self._closed:
                raise closed_error()
            if self._ctx is None or self._pid != os.getpid():  # a forked child needs its own
                self._ctx, self._pid = zmq.Context(), os.getpid()
            return self._ctx

    def _socket(self) -> zmq.Socket:
        sock = self._context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        setup_curve(sock, self._cfg)
        connect(sock, self.endpoint)
        return sock

    @contextlib.contextmanager
    def _unless_closed(self) -> Iterator[None]:
        """Socket work that close() in another thread may cut short: that ends as
        ClientClosedError, not as ZeroMQ's `Socket operation on non-socket`."""
        try:
            yield
        except zmq.ZMQError:
            if self._closed:
                raise closed_error() from None
            raise

    def _next_rid(self) -> int:
        with self._lock:
            return next(self._rids)

    def _recv(self, sock: zmq.Socket, timeout: float) -> P.Reply | None:
        if not sock.poll(max(timeout, 0) * 1000):
            return None
        frame = sock.recv()
        try:
            return codec.decode_reply(frame)
        except P.ProtocolError as e:  # a peer speaking another protocol version, or garbage
            raise reply_error(e, self.endpoint) from None

    def _exchange(self, sock: zmq.Socket, msg: Any, timeout: float | None, beats: bool = False) -> P.Reply:
        """Send (and re-send) until a reply to this rid arrives, by exchange_plan's rule."""
        msg.rid = self._next_rid()
        frame = encode_request(msg)
        sendable(frame, self._cfg)
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        plan = exchange_plan(msg.rid, end, self.retry_interval, self.heartbeat_timeout, beats, self.endpoint)
        sent = 0
        try:
            step = next(plan)
            while True:
                if step is SEND:
                    if send_now(sock, frame):
                        sent += 1
                    elif sent < REFUSED_BELOW:
                        raise unavailable(self.endpoint, refused=True)
                    step = next(plan)
                else:
                    step = plan.send(self._recv(sock, step))
        except StopIteration as done:
            return done.value

    def _call(self, msg: Any, timeout: float | None = None, beats: bool = False) -> P.Reply:
        sock = self._socket()
        try:
            with self._unless_closed():
                return self._exchange(sock, msg, timeout, beats)
        finally:
            sock.close(0)

    # ------------------------------------------------------------------ generation
    def stream(self, prompt: Any, **kw: Any) -> "Stream":
        """Iterator of Delta; `.result` holds the Result once exhausted. The job is sent at the
        first next(). Closing it early (or leaving a `with` block, or the process dying) cancels
        the job."""
        return Stream(self, make_submit(prompt, stream=True, **kw))

    def generate(self, prompt: Any, **kw: Any) -> Result:
        """Run one job to completion and return its Result (streamed underneath). Keywords are
        make_submit's: max_tokens, stop, system, temperature, top_p, top_k, seed, min_p,
        min_tokens_to_keep, verify_window, cache, ..."""
        with self.stream(prompt, **kw) as s:
            for _ in s:
                pass
            return s.result

    def submit(self, prompt: Any, **kw: Any) -> "JobHandle":
        """Queue a detached job (runs even if this process exits); returns a handle."""
        reply = self._call(make_submit(prompt, stream=False, **kw))
        return JobHandle(self, reply.job_id, reply.position)

    def job(self, job_id: str) -> "JobHandle":
        return JobHandle(self, job_id)

    # ------------------------------------------------------------------ control
    def cancel(self, job_id: str) -> dict:
        return self._call(P.Cancel(job_id=job_id)).data

    def status(self, job_id: str, timeout: float | None = None) -> P.Status:
        return self._call(P.JobStatus(job_id=job_id), opt_seconds(timeout, "timeout"))

    def stats(self, timeout: float | None = None) -> dict:
        return self._call(P.Stats(), opt_seconds(timeout, "timeout")).data

    def jobs(self) -> list[dict]:
        return self._call(P.Jobs()).data["jobs"]

    def models(self) -> list[dict]:
        return self._call(P.Models()).data["models"]

    def shutdown(self, timeout: float | None = None) -> dict:
        return self._call(P.Shutdown(), opt_seconds(timeout, "timeout")).data

    # ------------------------------------------------------------------ position lists
    def put_positions(self, name: str, positions: Sequence[int]) -> dict:
        """Store (or replace) a named sparse-prefill position list, shared by every app."""
        return self._call(P.PutPositions(name=name, positions=int_list(positions, "positions"))).data

    def get_positions(self, name: str) -> list[int]:
        """The list stored under `name`; NotFoundError when there is none."""
        return list(self._call(P.GetPositions(name=name)).data["positions"])

    def list_positions(self) -> list[str]:
        return list(self._call(P.ListPositions()).data["names"])

    def delete_positions(self, name: str) -> bool:
        """True when a list was deleted."""
        return bool(self._call(P.DeletePositions(name=name)).data["deleted"])

    # ------------------------------------------------------------------ prefix cache
    def clear_cache(self, timeout: float | None = None) -> dict:
        """Drop every prefix-cache snapshot, in the worker's RAM (L1) and on disk (L2), e.g. to
        free the disk or to forget users' prompts; named position lists are kept. Output never
        depends on the cache, so nothing else changes but the next prompts' prefill time.

        The worker runs it between jobs or decode cycles (a running job's prefill finishes
        first, its snapshots cleared too); `timeout` bounds the wait for the worker to take it,
        after which heartbeats keep it waiting. Returns {l1: {entries, bytes}, l2: {entries,
        bytes}, l2_up, position_lists}: what was dropped, and whether the cache process answered
        (False: L2 was not cleared; retry). CacheUnavailableError when the daemon has no cache."""
        try:
            return self._call(P.CacheClear(), opt_seconds(timeout, "timeout"), beats=True).data
        except E.DFlashError as e:
            raise older_worker(e, P.CacheClear.op) from None

    def close(self) -> None:
        """Close every socket of this client, streams in other threads included (they raise
        ClientClosedError); any later call raises ClientClosedError. Closing twice is fine."""
        with self._lock:
            self._closed = True
            if self._ctx is not None and self._pid == os.getpid():
                self._ctx.destroy(0)
            self._ctx = None

    def __enter__(self) -> "DFlashClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# How long a Stream waits for the answer to its Cancel. close() or cancel(): the caller asked to
# stop the job, so a live worker busy on a loaded CPU gets 2 s to take it, while a gone one costs
# at most that. A stream dropped unclosed (__del__: a garbage collection, or interpreter exit)
# waits only DROPPED_CANCEL_TIMEOUT_S: the worker also cancels a streamed job whose connection
# goes away, so there the Cancel only makes that immediate, not worth blocking the caller for.
CANCEL_TIMEOUT_S = 2.0
DROPPED_CANCEL_TIMEOUT_S = 0.3


class Stream:
    """One streamed job on its own socket: an iterator of Delta that ends with `.result` set.
    Nothing is sent and no socket is opened before the first next(), so a stream never iterated
    holds nothing; once it has ended (or was closed) iterating it again yields nothing. A plain
    iterator, not a generator holding the stream: dropping it (a `break`) releases it at once."""

    def __init__(self, client: DFlashClient, submit: P.Submit):
        self.client = client
        self.job_id = submit.job_id
        self.result: Result | None = None
        self.position = -1
        self._submit = submit
        self._sock: zmq.Socket | None = None
        self._started = False
        self._closed = False

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Delta:
        if self._closed:
            raise StopIteration
        try:
            delta = self._next_delta()
        except BaseException as e:
            # a socket closed under us, by close() in another thread: say so, not ZMQError's words
            cut = isinstance(e, zmq.ZMQError) and (self._closed or self.client._closed)
            what = "this stream" if self._closed else "its DFlashClient"
            self.close()
            if cut:
                raise closed_error(what) from None
            raise
        if delta is None:
            self.close()
            raise StopIteration
        return delta

    def _next_delta(self) -> Delta | None:
        """The next Delta; None once the job is done (`.result` set)."""
        c = self.client
        if self._sock is None:
            self._sock = c._socket()
            self.position = c._exchange(self._sock, self._submit, None).position
            self._started = True
        while True:
            reply = c._recv(self._sock, c.heartbeat_timeout)
            if reply is None:
                self._started = False  # the job outlives the worker: keep it, don't cancel it
                raise worker_gone(c.endpoint, c.heartbeat_timeout, self.job_id)
            if reply.rid != self._submit.rid or isinstance(reply, (P.Heartbeat, P.Accepted)):
                continue
            if isinstance(reply, P.Delta):
                return Delta(reply.text, list(reply.token_ids), list(reply.from_draft))
            if isinstance(reply, P.Done):
                self.result = Result.from_done(reply)
                return None
            if isinstance(reply, P.Error):
                # the job has ended here (failed), or is kept for the next start (shutting_down):
                # nothing to cancel. A cancel sent anyway waited 2 s on a stopping worker, and
                # one that reached a quick restart dropped the job the error said was kept.
                self._started = False
                raise E.from_reply(reply)

    def cancel(self, timeout: float = CANCEL_TIMEOUT_S) -> None:
        """Cancel the job if it may still run, waiting up to `timeout` seconds for the answer
        (CANCEL_TIMEOUT_S says why 2 s). Nothing is sent once the stream has seen the job end here
        (its result, an error reply, the worker's heartbeats stopping), so a stream whose worker
        is gone returns at once."""
        timeout = seconds(timeout, "timeout")
        if self._started and self.result is None:
            try:
                self.client._call(P.Cancel(job_id=self.job_id), timeout=timeout)
            except E.DFlashError:
                pass  # already finished, or the worker is gone: nothing left to stop

    def close(self) -> None:
        """Cancel the job if it is still running and free the socket; idempotent."""
        self._close(CANCEL_TIMEOUT_S)

    def _close(self, cancel_timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.cancel(cancel_timeout)
        finally:  # the socket is freed even if the cancel raised (e.g. at interpreter teardown)
            if self._sock is not None:
                self._sock.close(0)

    def __del__(self) -> None:
        """A stream dropped mid-job (a `break` out of its loop) cancels the job, as documented,
        but waits only DROPPED_CANCEL_TIMEOUT_S for the answer: a collection (or interpreter
        exit) blocked for the whole 2 s when the worker was gone."""
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self._close(DROPPED_CANCEL_TIMEOUT_S)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JobHandle:
    """A submitted job: poll its status, wait for its result, cancel it."""

    def __init__(self, client: DFlashClient, job_id: str, position: int = -1):
        self.client = client
        self.job_id = job_id
        self.position = position

    def status(self) -> str:
        return self.client.status(self.job_id).state

    def cancel(self) -> dict:
        return self.client.cancel(self.job_id)

    def result(self, timeout: float | None = None, poll: float = 0.1) -> Result:
        """Wait for the job (across worker restarts); raises the job's error if it failed.
        `timeout` bounds the whole wait, its status requests included; 0 looks once.
        ClientTimeoutError when the job is still unfinished then."""
        timeout, poll = opt_seconds(timeout, "timeout", zero_ok=True), seconds(poll, "poll")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else end - time.monotonic()
            st = self.client.status(self.job_id, look_timeout(self.client.timeout, left))
            if (res := finished(st, self.client.endpoint)) is not None:
                return res
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise waited_too_long(self.job_id, timeout)
            time.sleep(poll if left is None else min(poll, left))
