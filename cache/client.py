"""The worker's client of the cache process (DEALER -> ROUTER, msgpack header + raw payload).

Generation must never wait on or fail because of the cache process, so every call here returns
a miss / False / None instead of raising, and never blocks longer than `timeout_s`:
- IMMEDIATE: nothing is queued for a peer that is not connected, so a send while the cache
  process is down fails at once instead of piling up.
- After a timeout or a failed send the client rests for `retry_after_s` (calls return misses at
  once), then tries again; ZeroMQ reconnects by itself when the process comes back.
- A reply that arrives after its request timed out is recognised by its id and dropped.
`find` and `write` also return the id of the store that answered (the reply's `store`; None from
a cache process that does not send it), for the prefix cache's in-L2 marks (cache/marks.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 1
PUT_BYTES_PER_S = 32 << 20  # slowest store rate an acknowledged put is allowed before timing out
_NO_REPLY = object()  # a request was sent, its reply never came: what it did is unknown


@dataclass
class Written:
    """The outcome of an acknowledged put (`CacheClient.write`)."""

    stored: bool
    # the keys the cache process evicted to make room for this write (also when it failed);
    # None when that is unknown: the request went out and no reply came (timeout), or a reply
    # without the list (the process failed mid-write). [] when nothing was sent.
    evicted: list[str] | None
    # the id of the store that answered (None: no reply, or a cache process that sends none)
    store: str | None = field(default=None, compare=False)


@dataclass
class Found:
    """A `get` as answered (`CacheClient.find`): the first key held and its bytes, or none."""

    key: str | None  # None: the cache process holds none of the keys intact
    data: bytes | memoryview | None
    store: str | None  # the id of the store that answered (None: a process that sends none)


class CacheClient:
    """Talks to one cache process. Thread-safe (one lock); each call is one round trip."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 1.0,
        connect_timeout_s: float = 0.25,
        retry_after_s: float = 2.0,
        max_queued_puts: int = 8,
    ):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self.max_queued_puts = max_queued_puts
        self._ctx = zmq.Context.instance()  # shared, never terminated here: no hang at exit
        self._sock: zmq.Socket | None = None
        self._connected = False  # the current socket has sent at least once
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._down_until = 0.0
        # Bumped by every thread that calls (the prefix cache's lookups and remote stats; its
        # writer calls through a twin of its own), partly outside _lock (which a round trip
        # holds): their own small lock; read with counts().
        self.counters = dict(requests=0, timeouts=0, unavailable=0, dropped_puts=0, errors=0)
        self._counts_lock = threading.Lock()

    def twin(self) -> "CacheClient":
        """A client of the same process with the same settings and a socket, lock and rest of
        its own: the prefix cache's writer uses one, so a large write waiting for its
        acknowledgement (seconds on a loaded CPU) never holds up a lookup or a remote stats
        call behind this client's lock, and its timeout rests only the writes."""
        return CacheClient(self.endpoint, self.timeout_s, self.connect_timeout_s, self.retry_after_s,
                           self.max_queued_puts)

    # --- public calls --------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while resting after a failure (a call then returns a miss at once)."""
        return time.monotonic() >= self._down_until

    def counts(self) -> dict[str, int]:
        """A consistent copy of this client's counters."""
        with self._counts_lock:
            return dict(self.counters)

    def ping(self) -> bool:
        return self.call("ping") is not None

    def get_first(self, keys: list[str]) -> tuple[str, bytes | memoryview] | None:
        """The first of `keys` (in order) the cache process holds intact, with its bytes."""
        found = self.find(keys)
        if found is None or found.key is None:
            return None
        return found.key, found.data

    def find(self, keys: list[str]) -> Found | None:
        """`get_first` with the answering store's id, also on a miss; None: no answer."""
        if not keys:
            return None
        got = self._request({"op": "get", "keys": keys}, None, want_reply=True)
        if got is None:
            return None
        reply, data = got
        key = reply.get("key")
        if not reply.get("found") or data is None or not isinstance(key, str):
            return Found(None, None, _store(reply))
        return Found(key, data, _store(reply))

    def put(self, key: str, data: bytes | memoryview, wait: bool = False) -> bool:
        """Store bytes. wait=False: write-behind, True when handed to the socket (no ack);
        wait=True: True only once the cache process has stored them (refused, failed, timed
        out or unreachable: False)."""
        if wait:
            return self.write(key, data).stored
        got = self._request({"op": "put", "key": key, "ack": False}, data, want_reply=False)
        if got is None:
            self._count("dropped_puts")
            return False
        return True

    def write(self, key: str, data: bytes | memoryview) -> Written:
        """An acknowledged put: whether the cache process stored the bytes, and which keys it
        evicted to make room for them (None: unknown, the reply never came)."""
        # an acknowledged write may take the cache process a while to store (and check): its
        # timeout grows with its size, at PUT_BYTES_PER_S
        got = self._exchange({"op": "put", "key": key, "ack": True}, data, want_reply=True,
                             extra_s=len(data) / PUT_BYTES_PER_S)
        if got is None:  # never sent: nothing stored, nothing evicted
            self._count("dropped_puts")
            return Written(False, [])
        if got is _NO_REPLY:
            self._count("dropped_puts")
            return Written(False, None)
        reply = got[0]
        evicted = reply.get("evicted")
        if not isinstance(evicted, list) or not all(isinstance(k, str) for k in evicted):
            evicted = None
        stored = bool(reply.get("ok"))
        if not stored:
            self._count("dropped_puts")
        return Written(stored, evicted, _store(reply))

    def delete(self, key: str) -> bool:
        return self.call("delete", key=key) is not None

    def stats(self) -> dict[str, Any] | None:
        reply = self.call("stats")
        return None if reply is None else reply.get("stats")

    def clear(self) -> bool:
        return self.call("clear") is not None

    def call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """One request -> its reply map when ok, else None (down, timeout or error reply)."""
        got = self._request(dict(fields, op=op), None, want_reply=True)
        return None if got is None else got[0]

    def close(self) -> None:
        with self._lock:
            self._drop_socket()

    # --- transport -------------------------------------------------------------------------
    def _request(
        self, header: dict[str, Any], payload: bytes | memoryview | None, want_reply: bool, extra_s: float = 0.0
    ) -> tuple[dict[str, Any], memoryview | None] | None:
        """One request -> (reply, payload) when answered ok, else None."""
        got = self._exchange(header, payload, want_reply, extra_s)
        if got is None or got is _NO_REPLY or not got[0].get("ok"):
            return None
        return got

    def _exchange(
        self, header: dict[str, Any], payload: bytes | memoryview | None, want_reply: bool, extra_s: float = 0.0
    ) -> Any:
        """One request -> (reply, payload) as answered (error replies too, counted as errors),
        None when nothing was sent, or _NO_REPLY when it was sent and no reply came in time."""
        # Bounded wait for the lock: another thread's call (the prefix cache's writer awaiting a
        # write's acknowledgement) may hold it; a lookup gives up (a miss) rather than wait longer
        # than one call of its own would.
        if not self._lock.acquire(timeout=self.timeout_s + self.connect_timeout_s):
            self._count("unavailable")
            return None
        try:
            return self._locked_request(header, payload, want_reply, extra_s)
        finally:
            self._lock.release()

    def _locked_request(
        self, header: dict[str, Any], payload: bytes | memoryview | None, want_reply: bool, extra_s: float
    ) -> Any:
        if time.monotonic() < self._down_until:
            self._count("unavailable")
            return None
        self._count("requests")
        sock = self._socket()
        rid = next(self._ids)
        frames = [msgpack.packb(dict(header, v=PROTOCOL_VERSION, id=rid), use_bin_type=True)]
        if payload is not None:
            frames.append(payload)
        # Wait for a connection only on a new socket or when a reply is due; a write-behind
        # put on a connected socket that cannot be queued at once (peer gone or writes
        # piled up) is dropped instead of stalling generation.
        wait = want_reply or not self._connected
        if not sock.poll(int(1000 * self.connect_timeout_s) if wait else 0, zmq.POLLOUT):
            if wait:
                self._fail(timeout=False)
            return None
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self._fail(timeout=False)
            return None
        self._connected = True
        if not want_reply:
            return {"ok": True}, None
        return self._await(sock, rid, extra_s)

    def _await(self, sock: zmq.Socket, rid: int, extra_s: float = 0.0) -> Any:
        deadline = time.monotonic() + self.timeout_s + extra_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                self._fail(timeout=True)
                return _NO_REPLY
            frames = sock.recv_multipart(copy=False)  # a snapshot is read in place, not copied
            try:
                reply = msgpack.unpackb(frames[0].buffer, raw=False)
            except Exception:
                continue
            if not isinstance(reply, dict) or reply.get("id") != rid:
                continue  # a late reply to a request that already timed out
            if not reply.get("ok"):
                self._count("errors")
            return reply, (frames[1].buffer if len(frames) > 1 else None)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.SNDHWM, self.max_queued_puts)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            s.connect(self.endpoint)
            self._sock = s
            self._connected = False
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self.counters[name] += 1

    def _fail(self, timeout: bool) -> None:
        """Rest for retry_after_s; after a timeout, also drop the socket and its stale queue."""
        self._count("timeouts" if timeout else "unavailable")
        if timeout:
            self._drop_socket()
        self._down_until = time.monotonic() + self.retry_after_s


def _store(reply: dict[str, Any]) -> str | None:
    """The store id a reply names (`store`), None when it names none (an older cache process)."""
    s = reply.get("store")
    return s if isinstance(s, str) and s else None
