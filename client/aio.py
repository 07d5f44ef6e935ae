"""AsyncDFlashClient: the asyncio flavour of DFlashClient (same calls, awaited; zmq.asyncio)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from dflash.daemon import codec
from dflash.daemon import protocol as P
from dflash.daemon.config import DaemonConfig

from . import errors as E
from .client import Delta, Result, answers, client_config, int_list, make_submit, reply_error, setup_curve


class AsyncDFlashClient:
    """One socket per call, as in the sync client; safe to use from many tasks at once."""

    def __init__(self, endpoint: str | None = None, *, config: DaemonConfig | str | None = None,
                 timeout: float = 30.0, heartbeat_timeout: float = 1.5, retry_interval: float = 3.0):
        self.endpoint, self._cfg = client_config(endpoint, config)
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.retry_interval = retry_interval
        self._ctx = zmq.asyncio.Context()
        self._rids = itertools.count(1)

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        setup_curve(sock, self._cfg)
        sock.connect(self.endpoint)
        return sock

    async def _recv(self, sock: zmq.asyncio.Socket, timeout: float) -> P.Reply | None:
        if not await sock.poll(max(timeout, 0) * 1000):
            return None
        frame = await sock.recv()
        try:
            return codec.decode_reply(frame)
        except P.ProtocolError as e:  # a peer speaking another protocol version, or garbage
            raise reply_error(e, self.endpoint) from None

    async def _exchange(self, sock: zmq.asyncio.Socket, msg: Any, timeout: float | None) -> P.Reply:
        msg.rid = next(self._rids)
        frame = codec.encode(msg)
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            await sock.send(frame)
            retry_at = min(end, time.monotonic() + self.retry_interval)
            while (left := retry_at - time.monotonic()) > 0:
                reply = await self._recv(sock, left)
                if answers(reply, msg.rid):
                    if isinstance(reply, P.Error):
                        raise E.from_reply(reply)
                    return reply
            if time.monotonic() >= end:
                raise E.WorkerUnavailableError("unavailable", f"no dflash worker answered at {self.endpoint}")

    async def _call(self, msg: Any, timeout: float | None = None) -> P.Reply:
        sock = self._socket()
        try:
            return await self._exchange(sock, msg, timeout)
        finally:
            sock.close(0)

    async def stream(self, prompt: Any, **kw: Any) -> AsyncIterator[Delta | Result]:
        """Yields Delta objects, then the final Result; leaving early cancels the job."""
        sub = make_submit(prompt, stream=True, **kw)
        sock = self._socket()
        finished = False
        try:
            await self._exchange(sock, sub, None)
            while True:
                reply = await self._recv(sock, self.heartbeat_timeout)
                if reply is None:
                    finished = True  # the job outlives the worker: keep it, don't cancel it
                    raise E.WorkerGoneError("worker_gone", f"the worker at {self.endpoint} stopped answering", sub.job_id)
                if reply.rid != sub.rid or isinstance(reply, (P.Heartbeat, P.Accepted)):
                    continue
                if isinstance(reply, P.Delta):
                    yield Delta(reply.text, list(reply.token_ids), list(reply.from_draft))
                elif isinstance(reply, P.Done):
                    finished = True
                    yield Result.from_done(reply)
                    return
                elif isinstance(reply, P.Error):
                    finished = True
                    raise E.from_reply(reply)
        finally:
            sock.close(0)
            if not finished:
                try:
                    await self._call(P.Cancel(job_id=sub.job_id), timeout=2.0)
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
        end = None if timeout is None else time.monotonic() + timeout
        while end is None or time.monotonic() < end:
            st = await self._call(P.JobStatus(job_id=job_id))
            if st.result is not None:
                reply = P.parse_reply(st.result)
                if isinstance(reply, P.Error):
                    raise E.from_reply(reply)
                return Result.from_done(reply)
            await asyncio.sleep(poll)
        raise E.ClientTimeoutError("timeout", f"job {job_id} not finished in {timeout:g}s", job_id)

    async def cancel(self, job_id: str) -> dict:
        return (await self._call(P.Cancel(job_id=job_id))).data

    async def status(self, job_id: str) -> P.Status:
        return await self._call(P.JobStatus(job_id=job_id))

    async def stats(self) -> dict:
        return (await self._call(P.Stats())).data

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

    def close(self) -> None:
        self._ctx.destroy(0)
