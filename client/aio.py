"""AsyncDFlashClient: the asyncio flavour of DFlashClient (same calls, awaited; zmq.asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any, AsyncIterator, Iterator

import zmq
import zmq.asyncio

from dflash.daemon import codec
from dflash.daemon import protocol as P
from dflash.daemon.config import DaemonConfig

from . import errors as E
from .client import (
    CANCEL_TIMEOUT_S,
    REFUSED_BELOW,
    SEND,
    Delta,
    Result,
    client_config,
    client_timings,
    closed_error,
    connect,
    encode_request,
    exchange_plan,
    finished,
    int_list,
    look_timeout,
    make_submit,
    older_worker,
    opt_seconds,
    reply_error,
    seconds,
    sendable,
    setup_curve,
    unavailable,
    waited_too_long,
    worker_gone,
)


async def send_now(sock: zmq.asyncio.Socket, frame: bytes) -> bool:
    """client.send_now, awaited: False when the send would wait (see client.REFUSED_BELOW); an
    awaited send then waited forever, past every timeout."""
    try:
        await sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def _cancel_requested() -> bool:
    """Whether the current task itself was cancelled (Python >= 3.11 can tell; before that, a
    closed client's CancelledError is taken as the close's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


class AsyncDFlashClient:
    """One socket per call, as in the sync client; safe to use from many tasks at once.
    `async with AsyncDFlashClient() as a:` closes it at the end of the block."""

    def __init__(self, endpoint: str | None = None, *, config: DaemonConfig | str | None = None,
                 timeout: float = 30.0, heartbeat_timeout: float = 1.5, retry_interval: float = 3.0):
        self.endpoint, self._cfg = client_config(endpoint, config)
        self.timeout, self.heartbeat_timeout, self.retry_interval = client_timings(
            timeout, heartbeat_timeout, retry_interval)
        self._ctx = zmq.asyncio.Context()
        self._rids = itertools.count(1)
        self._closed = False

    def _socket(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise closed_error("this AsyncDFlashClient")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        setup_curve(sock, self._cfg)
        connect(sock, self.endpoint)
        return sock

    @contextlib.contextmanager
    def _unless_closed(self) -> Iterator[None]:
        """Socket work that close() cuts short ends as ClientClosedError: zmq.asyncio cancels
        the pending receive, which reached a task nobody had cancelled as CancelledError."""
        try:
            yield
        except zmq.ZMQError:
            if self._closed:
                raise closed_error("this AsyncDFlashClient") from None
            raise
        except asyncio.CancelledError:
            if self._closed and not _cancel_requested():
                raise closed_error("this AsyncDFlashClient") from None
            raise

    async def _recv(self, sock: zmq.asyncio.Socket, timeout: float) -> P.Reply | None:
        if not await sock.poll(max(timeout, 0) * 1000):
            return None
        frame = await sock.recv()
        try:
            return codec.decode_reply(frame)
        except P.ProtocolError as e:  # a peer speaking another protocol version, or garbage
            raise reply_error(e, self.endpoint) from None

    async def _exchange(self, sock: zmq.asyncio.Socket, msg: Any, timeout: float | None,
                        beats: bool = False) -> P.Reply:
        """As DFlashClient._exchange: re-send until answered; with `beats`, once heartbeats for
        it come, wait as long as they do instead (exchange_plan, the one rule for both)."""
        msg.rid = next(self._rids)
        frame = encode_request(msg)
        sendable(frame, self._cfg)
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        plan = exchange_plan(msg.rid, end, self.retry_interval, self.heartbeat_timeout, beats, self.endpoint)
        sent = 0
        try:
            step = next(plan)
            while True:
                if step is SEND:
                    if await send_now(sock, frame):
                        sent += 1
                    elif sent < REFUSED_BELOW:  # the peer refused the handshake: see client.py
                        raise unavailable(self.endpoint, refused=True)
                    step = next(plan)
                else:
                    step = plan.send(await self._recv(sock, step))
        except StopIteration as done:
            return done.value

    async def _call(self, msg: Any, timeout: float | None = None, beats: bool = False) -> P.Reply:
        sock = self._socket()
        try:
            with self._unless_closed():
                return await self._exchange(sock, msg, timeout, beats)
        finally:
            sock.close(0)

    async def stream(self, prompt: Any, **kw: Any) -> AsyncIterator[Delta | Result]:
        """Yields Delta objects, then the final Result; leaving early cancels the job."""
        sub = make_submit(prompt, stream=True, **kw)
        sock = self._socket()
        running = False  # accepted and not ended: only then is there a job to cancel
        try:
            with self._unless_closed():
                await self._exchange(sock, sub, None)
                running = True
                while True:
                    reply = await self._recv(sock, self.heartbeat_timeout)
                    if reply is None:
                        running = False  # the job outlives the worker: keep it, don't cancel it
                        raise worker_gone(self.endpoint, self.heartbeat_timeout, sub.job_id)
                    if reply.rid != sub.rid or isinstance(reply, (P.Heartbeat, P.Accepted)):
                        continue
                    if isinstance(reply, P.Delta):
                        yield Delta(reply.text, list(reply.token_ids), list(reply.from_draft))
                    elif isinstance(reply, P.Done):
                        running = False
                        yield Result.from_done(reply)
                        return
                    elif isinstance(reply, P.Error):
                        running = False
                        raise E.from_reply(reply)
        finally:
            sock.close(0)
            if running:
                try:
                    await self._call(P.Cancel(job_id=sub.job_id), timeout=CANCEL_TIMEOUT_S)
                except (E.DFlashError, asyncio.CancelledError):
                    pass

    async def generate(self, prompt: Any, **kw: Any) -> Result:
        async for ev in self.stream(prompt, **kw):
            if isinstance(ev, Result):
                return ev
        raise E.JobFailedError("internal", "stream ended without a result")

    async def submit(self, prompt: Any, **kw: Any) -> str:
        """Queue a detached job; returns its id (see result())."""
        return (await self._call(make_submit(prompt, stream=False, **kw))).job_id

    async def result(self, job_id: str, timeout: float | None = None, poll: float = 0.1) -> Result:
        """Wait for the job and return its Result, as JobHandle.result: `timeout` bounds the
        whole wait, its status requests included; 0 looks once."""
        timeout, poll = opt_seconds(timeout, "timeout", zero_ok=True), seconds(poll, "poll")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else end - time.monotonic()
            st = await self.status(job_id, look_timeout(self.timeout, left))
            if (res := finished(st, self.endpoint)) is not None:
                return res
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise waited_too_long(job_id, timeout)
            await asyncio.sleep(poll if left is None else min(poll, left))

    async def cancel(self, job_id: str) -> dict:
        return (await self._call(P.Cancel(job_id=job_id))).data

    async def status(self, job_id: str, timeout: float | None = None) -> P.Status:
        return await self._call(P.JobStatus(job_id=job_id), opt_seconds(timeout, "timeout"))

    async def stats(self, timeout: float | None = None) -> dict:
        return (await self._call(P.Stats(), opt_seconds(timeout, "timeout"))).data

    async def shutdown(self, timeout: float | None = None) -> dict:
        return (await self._call(P.Shutdown(), opt_seconds(timeout, "timeout"))).data

    async def jobs(self) -> list[dict]:
        return (await self._call(P.Jobs())).data["jobs"]

    async def models(self) -> list[dict]:
        return (await self._call(P.Models())).data["models"]

    async def put_positions(self, name: str, positions: list[int]) -> dict:
        return (await self._call(P.PutPositions(name=name, positions=int_list(positions, "positions")))).data

    async def get_positions(self, name: str) -> list[int]:
        return list((await self._call(P.GetPositions(name=name))).data["positions"])

    async def list_positions(self) -> list[str]:
        return list((await self._call(P.ListPositions())).data["names"])

    async def delete_positions(self, name: str) -> bool:
        return bool((await self._call(P.DeletePositions(name=name))).data["deleted"])

    async def clear_cache(self, timeout: float | None = None) -> dict:
        """Drop every prefix-cache snapshot (L1 and L2), keeping position lists; the same call
        and answer as DFlashClient.clear_cache."""
        try:
            return (await self._call(P.CacheClear(), opt_seconds(timeout, "timeout"), beats=True)).data
        except E.DFlashError as e:
            raise older_worker(e, P.CacheClear.op) from None

    def close(self) -> None:
        """Close every socket of this client; any later call raises ClientClosedError."""
        self._closed = True
        self._ctx.destroy(0)

    async def __aenter__(self) -> "AsyncDFlashClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
