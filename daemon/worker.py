"""The worker process: a ROUTER socket thread in front of the single MLX compute thread.

The socket (main) thread decodes and validates every frame, answers control requests at once
(status, stats, cancel, shutdown are never queued behind work), persists and queues submits,
forwards the compute thread's events to the connection that waits on each job, and sends
heartbeats. A cache clear is handed to the compute thread (the only one that touches L1 and
queues L2 writes) and answered when it has run, with heartbeats meanwhile. Replies go out with
ROUTER_MANDATORY, so a send to a connection that went away fails at once: the job it was
streaming to is cancelled.

After a restart, unfinished detached jobs are queued again at once. A streamed job's client has
already seen `worker_gone` (or `shutting_down`) by then and may well have gone for good, so its
job is held instead: re-queued only when someone asks for it (a re-sent submit, a status poll,
as `client.job(id).result()` and `dflash-client result ID` do), dropped unasked after
`result_retention_s`. Jobs no one wants thus never block the queue.

Run as `python -m dflash.daemon.worker --config-json JSON` (the supervisor does this) or
`--config FILE` (launchd). Exit codes: 0 shutdown requested, 2 bad configuration (or, with
`exit_on_load_failure`, a model that failed to load: a service manager then sees the failure
instead of a worker idling in "failed"), 3 another worker holds the lock; anything else is a
crash and the supervisor restarts it. Exits 2 and 3 leave their reason for the supervisor
(supervisor.write_exit_reason).
"""

from __future__ import annotations

import argparse
import faulthandler
import fcntl
import itertools
import logging
import os
import secrets
import signal
import sqlite3
import sys
import threading
import time
import uuid
from typing import Any

import zmq
import zmq.auth

from dflash.cache.client import CacheClient
from dflash.cache.positions import PositionStore, Unavailable

from dflash.engine import accel, draftvocab
from dflash.engine.window import confidence_windows, wide_windows

from . import caching, codec, lifeline, paths
from . import protocol as P
from .compute import Compute
from .config import LIMIT_FIELDS, DaemonConfig, load_config
from .supervisor import write_exit_reason
from .queue import Job, JobQueue
from .store import JobStore

log = logging.getLogger("dflash.worker")
_WAKE = "inproc://dflash-compute-events"


class Worker:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.endpoint = cfg.resolved_endpoint()
        self.jobs = JobQueue(cfg.max_queue)
        jobs_dir = paths.private_dir(paths.private_dir(cfg.state_path()) / "jobs")  # an older version's: 0755
        self.store = JobStore(jobs_dir, cfg.result_retention_s)
        self.ctx = zmq.Context()
        self.compute = Compute(cfg, self.jobs, self.store, self._wake)
        self.watchers: dict[str, tuple[bytes, int]] = {}  # job id -> (connection, submit rid)
        self.router: zmq.Socket | None = None  # the bound socket, once serve() runs (socket thread only)
        self.held: dict[str, Job] = {}  # recovered streamed jobs that wait to be asked for
        self.waiting: dict[str, tuple[bytes, int]] = {}  # control work key -> (connection, rid)
        self._work_ids = itertools.count(1)
        self.stop = threading.Event()
        self.exit_code = 0
        self.started = time.time()
        self.counters = {"frames": 0, "bad_frames": 0, "dropped_replies": 0, "clients_gone": 0, "recovered": 0, "failed_on_recovery": 0}
        self._wake_local = threading.local()
        # The socket thread's own link to the cache process (position lists, remote stats); a
        # short timeout keeps heartbeats flowing if the cache process hangs.
        self.cache_client = CacheClient(cfg.resolved_cache_endpoint(), timeout_s=0.5) if cfg.cache else None
        self.positions = PositionStore(self.cache_client, strict=True) if self.cache_client else None

    # ------------------------------------------------------------------ sockets
    def _wake(self) -> None:
        """Called on the compute thread: nudge the socket thread through its own inproc socket."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._wake_local.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(_WAKE)
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # wake-ups already pending: the socket thread will drain all events
            pass

    def _compute_main(self) -> None:
        try:
            self.compute.run()
        finally:  # the wake socket belongs to this thread: close it here so the context can end
            sock = getattr(self._wake_local, "sock", None)
            if sock is not None:
                sock.close(0)

    def _bind(self) -> zmq.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 100_000)
        router.setsockopt(zmq.MAXMSGSIZE, codec.DROP_FACTOR * self.cfg.max_frame_bytes)  # beyond: peer dropped
        if self.cfg.curve_server_secret:
            public, secret = zmq.auth.load_certificate(self.cfg.curve_server_secret)
            router.curve_secretkey, router.curve_publickey, router.curve_server = secret, public, True
        router.bind(self.endpoint)
        paths.secure_ipc_socket(self.endpoint)
        return router

    def _send(self, router: zmq.Socket, ident: bytes, msg: Any) -> bool:
        """False when the connection is gone (ROUTER_MANDATORY), so its jobs can be cancelled."""
        try:
            router.send_multipart([ident, codec.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            self.counters["dropped_replies"] += 1  # EAGAIN: a peer that stopped reading
            return True

    # ------------------------------------------------------------------ main loop
    def serve(self) -> int:
        router = self.router = self._bind()
        wake = self.ctx.socket(zmq.PULL)
        wake.bind(_WAKE)
        self._recover()
        thread = threading.Thread(target=self._compute_main, name="dflash-mlx", daemon=True)
        thread.start()
        log.info("worker %d listening on %s (%s)", os.getpid(), self.endpoint, accel.describe())
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_beat = time.monotonic() + self.cfg.heartbeat_s
        while not self.stop.is_set():
            timeout = max(0.0, next_beat - time.monotonic())
            ready = dict(poller.poll(timeout * 1000))
            if wake in ready:
                while wake.poll(0):
                    wake.recv()
            self._forward_events(router)
            if router in ready:
                for _ in range(256):  # bounded batch so events and heartbeats keep flowing
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(router, frames)
            if time.monotonic() >= next_beat:
                self._heartbeat(router)
                next_beat = time.monotonic() + self.cfg.heartbeat_s
            if self.cfg.exit_on_load_failure and self.compute.load_error:
                self._exit_on_load_failure()
        log.info("shutting down")
        self.compute.stop()
        thread.join(timeout=30)
        self._forward_events(router)
        self._abandon_waiting(router)
        router.close(0)
        wake.close(0)
        if not thread.is_alive():
            self.ctx.term()
        self.store.close()
        if self.cache_client is not None:
            self.cache_client.close()
        sock = paths.ipc_path(self.endpoint)
        if sock is not None:
            sock.unlink(missing_ok=True)
        log.info("stopped")
        return self.exit_code

    def _exit_on_load_failure(self) -> None:
        """Stop with exit 2 and the reason: a service manager (systemd, launchd) then shows the
        failure, rather than a worker that stays up answering every job with the load error."""
        reason = f"the model failed to load: {self.compute.load_error}"
        log.error("%s; exiting with 2 (exit_on_load_failure)", reason)
        write_exit_reason(reason)
        self.exit_code = 2
        self.stop.set()

    def _recover(self) -> None:
        jobs, failed = self.store.recover(self.cfg.max_attempts)
        for job in jobs:
            if job.stream:  # its client heard the worker go: run it only if someone asks again
                if self.store.hold(job):  # else its hold ran out across restarts
                    self.held[job.job_id] = job
            else:
                self.jobs.push(job, force=True)
        self.counters["recovered"] = len(jobs)
        self.counters["failed_on_recovery"] = len(failed)
        if jobs or failed:
            log.info("recovered %d unfinished job(s) (%d streamed ones held until asked for); failed %d that "
                     "crashed too often", len(jobs), len(self.held), len(failed))

    def _claim(self, job_id: str) -> None:
        """Someone asked for a held job: queue it (unless its hold ran out meanwhile)."""
        job = self.held.pop(job_id, None)
        if job is None or not self.store.has_job(job_id):
            return
        job.state, job.held_at = "queued", 0.0
        self.store.save(job)  # no expiry any more
        self.jobs.push(job, force=True)
        log.info("job %s asked for again: queued", job_id)

    def _abandon_waiting(self, router: zmq.Socket) -> None:
        """Answer what the compute thread never got to, since it stopped first: control requests,
        and the streams of queued jobs (kept for the next start). Those streams used to hear
        nothing: their heartbeats just stopped, and a clean stop reached them 1.5 s later as
        worker_gone, "stopped answering" (an HTTP 503 that read like a crash)."""
        for ident, rid in self.waiting.values():
            self._send(router, ident, P.Error(rid=rid, code=P.SHUTTING_DOWN, message="the worker stopped "
                                              "before clearing the cache; nothing was cleared: retry once it is back"))
        self.waiting.clear()
        for job_id, (ident, rid) in self.watchers.items():
            self._send(router, ident, P.shutdown_error(job_id, rid))
        self.watchers.clear()

    def _forward_events(self, router: zmq.Socket) -> None:
        while True:
            try:
                job_id, msg = self.compute.events.get_nowait()
            except Exception:
                return
            if (waiter := self.waiting.pop(job_id, None)) is not None:  # a control request's answer
                msg.rid = waiter[1]
                self._send(router, waiter[0], msg)
                continue
            watcher = self.watchers.get(job_id)
            final = isinstance(msg, (P.Done, P.Error))
            if watcher is not None:
                msg.rid = watcher[1]
                if not self._send(router, watcher[0], msg):
                    self._client_gone(job_id)
            if final:
                self.watchers.pop(job_id, None)

    def _heartbeat(self, router: zmq.Socket) -> None:
        for job_id, (ident, rid) in list(self.watchers.items()):
            if not self._send(router, ident, P.Heartbeat(rid=rid)):
                self._client_gone(job_id)
        for key, (ident, rid) in list(self.waiting.items()):
            if not self._send(router, ident, P.Heartbeat(rid=rid)):
                self.waiting.pop(key, None)  # it still runs; nobody is left to hear the answer
        cutoff = time.time() - self.cfg.result_retention_s
        for job_id in [j for j, job in self.held.items() if job.held_at < cutoff]:
            del self.held[job_id]  # nobody asked; its record has expired in the store too

    def _client_gone(self, job_id: str) -> None:
        """The connection streaming job_id has gone: a streamed job is cancelled with it. A
        detached one (submitted with stream false) only loses the watcher: a connection that
        re-attached to it (the same submit sent again with stream true) and then went away
        used to cancel it, though no one had asked for that and its owner still polled for it."""
        self.watchers.pop(job_id, None)
        self.counters["clients_gone"] += 1
        live = self.jobs.get(job_id)
        if live is not None and not live.stream:
            return
        job = self.jobs.cancel(job_id, "cancelled")
        if job is not None and job.state == "cancelled":  # was queued: never reaches compute
            self._finish_unstarted(job)

    def _finish_unstarted(self, job: Job) -> P.Done:
        done = P.Done(job_id=job.job_id, finish_reason="cancelled", stats={"finish_reason": "cancelled"})
        self.store.finish(job.job_id, P.to_map(done))
        self.compute.counters["jobs_cancelled"] += 1
        return done

    # ------------------------------------------------------------------ requests
    def _on_frames(self, router: zmq.Socket, frames: list[bytes]) -> None:
        self.counters["frames"] += 1
        ident = frames[0]
        try:
            if len(frames) != 2:
                raise P.ProtocolError(P.BAD_FRAME, f"expected one frame per message, got {len(frames) - 1}")
            req = codec.decode_request(frames[1], self.cfg.max_frame_bytes)
        except P.ProtocolError as e:
            self.counters["bad_frames"] += 1
            rid = codec.peek_rid(frames[1]) if len(frames) == 2 and e.code != P.TOO_LARGE else 0
            err = P.Error(rid=rid, code=e.code, message=e.message, param=e.param or "")
            # An older client can only decode a reply of its own version: the error layout is
            # the same in every version, so it gets the mismatch as a typed error it can read.
            old = e.peer_version if type(e.peer_version) is int and e.peer_version in P.OLDER_VERSIONS else None
            self._send(router, ident, err if old is None else P.to_map(err, version=old))
            return
        try:
            reply = self._dispatch(ident, req)
            if reply is None:  # answered later, when the compute thread has done it
                return
        except P.ProtocolError as e:
            self.counters["bad_frames"] += 1
            # a refused submit queued nothing: no job id to name (its error would point at none)
            job_id = "" if isinstance(req, P.Submit) else getattr(req, "job_id", "")
            reply = P.Error(code=e.code, message=e.message, job_id=job_id, param=e.param or "")
        except sqlite3.Error as e:  # the job store (diskcache's SQLite): a full or read-only disk
            log.error("request failed: the job store could not record it: %s", P.reason_line(e))
            then = "; the job was not queued: retry once there is room" if isinstance(req, P.Submit) else ""
            reply = P.store_error(P.INTERNAL, "the request", e, then=then)
        except Exception as e:  # a bug here must not take the worker down
            log.exception("request failed")
            reply = P.Error(code=P.INTERNAL, message=f"{type(e).__name__}: {e}")
        reply.rid = req.rid
        self._send(router, ident, reply)
        if isinstance(req, P.Shutdown):
            self.stop.set()

    def _dispatch(self, ident: bytes, req: P.Request) -> Any:
        if isinstance(req, P.Submit):
            return self._submit(ident, req)
        if isinstance(req, P.Cancel):
            return self._cancel(req.job_id)
        if isinstance(req, P.JobStatus):
            return self._status(req.job_id)
        if isinstance(req, P.Stats):
            return P.Info(data=self.stats())
        if isinstance(req, P.Jobs):
            rows = [_job_row(j, self.jobs) for j in [*self.jobs.snapshot(), *self.held.values()]]
            return P.Info(data={"jobs": rows})
        if isinstance(req, P.Models):
            return P.Info(data={"models": [self.compute.models()]})
        if isinstance(req, P.Shutdown):
            return P.Info(data={"shutting_down": True, "pid": os.getpid()})
        if isinstance(req, P.POSITION_OPS):
            return P.Info(data=self._position_op(req))
        if isinstance(req, P.CacheClear):
            return self._cache_clear(ident, req)
        raise P.ProtocolError(P.UNKNOWN_OP, "unhandled op")

    def _submit(self, ident: bytes, req: P.Submit) -> Any:
        self._validate(req)
        if self.compute.load_error:
            raise P.ProtocolError(P.NOT_READY, f"model failed to load: {self.compute.load_error}")
        job_id = req.job_id or uuid.uuid4().hex
        if (mismatch := self._other_request(job_id, req)) is not None:
            raise P.ProtocolError(P.BAD_REQUEST, f"job id {job_id!r} is taken by a different request that has not "
                                  f"finished ({mismatch} differs): choose another job id, or leave it unset",
                                  param="job_id")
        if self.store.known(job_id):  # a retried submit: answer for the job we already have
            self._claim(job_id)
            if self.jobs.get(job_id) is not None and req.stream:
                self._watch(job_id, ident, req.rid)
            elif req.stream and (res := self.store.result(job_id)) is not None:
                self.compute.events.put((job_id, P.parse_reply(P.current_result(res))))
                self._watch(job_id, ident, req.rid)
            return P.Accepted(job_id=job_id, position=max(self.jobs.position(job_id), 0))
        if self.jobs.queued_count() >= self.cfg.max_queue:
            raise P.ProtocolError(P.BUSY, f"queue full ({self.cfg.max_queue} jobs waiting); try again later")
        limit = self.cfg.job_timeout_s if req.timeout_s is None else min(req.timeout_s, self.cfg.job_timeout_s)
        fields = P.to_map(req)
        request = {k: fields[k] for k in (*_PROMPT_FIELDS, "cache", "positions")}
        if req.positions_name is not None:  # resolved now: the job is durable and self-contained
            request["positions"] = self._named_positions(req)
        if req.template_args:  # chat template keyword arguments (gateway: chat_template_kwargs)
            request["template_args"] = req.template_args
        request["sampling"] = self._sampling(req)
        # resolved now too (unset: the worker's setting), so a re-run after a crash repeats it
        request["verify_window"] = self.cfg.window() if req.verify_window is None else req.verify_window
        job = Job(job_id, self.store.next_seq(), request, req.priority, req.stream, 0, limit)
        self.store.save(job)  # durable before the client hears "accepted"
        if req.stream:
            self._watch(job_id, ident, req.rid)
        position = self.jobs.push(job, force=True)
        return P.Accepted(job_id=job_id, position=position)

    def _other_request(self, job_id: str, req: P.Submit) -> str | None:
        """The first prompt field in which `req` differs from the unfinished job (queued, running
        or held) that has this id; None when they agree or there is no such job. A re-sent
        submit (a lost reply) repeats its fields, so it still answers for the job it queued; a
        different request that reused the id used to be answered `accepted` for the other job
        and then streamed that job's text, as if it were its own."""
        job = self.jobs.get(job_id) or self.held.get(job_id)
        if job is None:
            return None
        fields = P.to_map(req)
        for name in _PROMPT_FIELDS:
            if name in job.request and _plain(fields.get(name)) != _plain(job.request[name]):  # (older records: fewer)
                return name
        return None

    def _watch(self, job_id: str, ident: bytes, rid: int) -> None:
        """Stream job_id's events to this connection. Another connection that streamed it (a
        second submit of the same job id took the job over) is told so and ends: it used to hear
        nothing more, and the end of its heartbeats read as "the worker stopped answering"."""
        old = self.watchers.get(job_id)
        if old is not None and old[0] != ident and self.router is not None:
            self._send(self.router, old[0], P.Error(
                rid=old[1], code=P.BAD_REQUEST, job_id=job_id, param="job_id",
                message=f"job {job_id!r} was submitted again from another connection, which streams it from now on: "
                        "this stream ends here (the job goes on; its status gives its result)"))
        self.watchers[job_id] = (ident, rid)

    def _sampling(self, req: P.Submit) -> dict[str, Any]:
        """The job's sampling, resolved now (unset fields: the configured defaults) so the job is
        self-contained: a sampled job without a seed gets a random one, so a re-run after a
        crash repeats it and done.stats.sampling says how to reproduce it."""
        cfg = self.cfg
        out = {"temperature": float(cfg.temperature if req.temperature is None else req.temperature),
               "top_p": float(cfg.top_p if req.top_p is None else req.top_p),
               "top_k": int(cfg.top_k if req.top_k is None else req.top_k),
               "seed": cfg.seed if req.seed is None else req.seed,
               "min_p": float(cfg.min_p if req.min_p is None else req.min_p),
               "min_tokens_to_keep": int(cfg.min_tokens_to_keep if req.min_tokens_to_keep is None
                                         else req.min_tokens_to_keep)}
        if out["temperature"] > 0 and out["seed"] is None:
            out["seed"] = secrets.randbits(63)
        return {**out, **self._processors(req)}

    def _processors(self, req: P.Submit) -> dict[str, Any]:
        """The job's logits processors (engine/processors.py), resolved like its sampling and
        reported as `dflash generate --json` reports them (ProcessorParams.reported)."""
        from dflash.engine.processors import ProcessorParams  # MLX: imported once the accelerator is set

        value = {k: getattr(self.cfg, k) if getattr(req, k) is None else getattr(req, k) for k in P.PENALTY_FIELDS}
        return ProcessorParams(logit_bias=req.logit_bias or None, **value).reported()

    def _validate(self, req: P.Submit) -> None:
        def bad(msg: str, param: str) -> P.ProtocolError:
            return P.ProtocolError(P.BAD_REQUEST, msg, param=param)

        given = [n for n in ("text", "messages", "token_ids") if getattr(req, n) is not None]
        if len(given) != 1:
            raise bad("exactly one of text, messages, token_ids is required", given[1] if given else "text")
        if req.text is not None and not req.text.strip():
            raise bad("empty prompt", "text")
        if req.messages is not None:
            if not req.messages:
                raise bad("empty message list", "messages")
            for m in req.messages:
                if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise bad("each message needs string 'role' and 'content'", "messages")
        if req.token_ids is not None:
            if not req.token_ids:
                raise bad("empty token_ids", "token_ids")
            if len(req.token_ids) > self.cfg.max_prompt_tokens:
                raise bad(f"{len(req.token_ids)} prompt tokens exceed max_prompt_tokens={self.cfg.max_prompt_tokens}",
                          "token_ids")
        if not 1 <= req.max_tokens <= self.cfg.max_tokens_limit:
            raise bad(f"max_tokens must be in 1..{self.cfg.max_tokens_limit}, got {req.max_tokens}", "max_tokens")
        if (problem := P.stops_problem(req.stop)) is not None:
            raise bad(problem, "stop")
        if not -1000 <= req.priority <= 1000:
            raise bad("priority must be in -1000..1000", "priority")
        if req.timeout_s is not None and not req.timeout_s > 0:
            raise bad("timeout_s must be > 0", "timeout_s")
        P.check_submit(req)  # job id, token ids >= 0, sampling: the rules the clients check too
        from dflash.engine.processors import bias_vocab_problem  # MLX: imported once the accelerator is set

        vocab = self.compute.vocab_size  # 0 until the model is loaded: the job is checked when it runs
        if vocab and (problem := bias_vocab_problem(req.logit_bias, vocab)) is not None:
            raise P.ProtocolError(P.BAD_SAMPLING, problem, param="logit_bias")
        self._validate_sparse(req)

    def _validate_sparse(self, req: P.Submit) -> None:
        if req.cache is not None and req.cache not in P.CACHE_POLICIES:
            raise P.ProtocolError(P.BAD_REQUEST, f"cache must be one of {', '.join(P.CACHE_POLICIES)}, "
                                  f"got {P.shown(req.cache)}", param="cache")
        if req.positions is not None and req.positions_name is not None:
            raise P.ProtocolError(P.BAD_REQUEST, "give positions or positions_name, not both", param="positions_name")
        sparse = req.positions is not None or req.positions_name is not None
        if sparse and req.cache in ("use", "refresh"):
            raise P.ProtocolError(P.SPARSE_WITH_CACHE, "sparse prefill cannot use the prefix cache (its caches "
                                  "are position-scattered): leave cache unset or set it to \"bypass\"", param="cache")
        if sparse and self.cfg.kv_bits:
            raise P.ProtocolError(P.BAD_REQUEST, "sparse prefill cannot be combined with kv_bits (worker setting)")
        if req.positions_name is not None:
            _check_list_name(req.positions_name)
        if req.positions is not None:
            _check_positions(req.positions, self.cfg.max_prompt_tokens,
                             None if req.token_ids is None else len(req.token_ids))

    def _named_positions(self, req: P.Submit) -> list[int]:
        values = self._position_op(P.GetPositions(name=req.positions_name))["positions"]
        _check_positions(values, self.cfg.max_prompt_tokens, None if req.token_ids is None else len(req.token_ids))
        return values

    def _position_op(self, req: Any) -> dict[str, Any]:
        """put / get / list / delete a named position list in the cache process."""
        if self.positions is None:
            raise P.ProtocolError(P.CACHE_UNAVAILABLE, "the cache is disabled in this daemon (cache = false)")
        if not isinstance(req, P.ListPositions):
            _check_list_name(req.name)
        try:
            if isinstance(req, P.PutPositions):
                _check_positions(req.positions, self.cfg.max_prompt_tokens, None)
                if not self.positions.put(req.name, req.positions):
                    raise Unavailable("the cache process refused the list")
                return {"name": req.name, "stored": len(req.positions)}
            if isinstance(req, P.GetPositions):
                values = self.positions.get(req.name)
                if values is None:
                    raise P.ProtocolError(P.NOT_FOUND, f"no position list named {req.name!r}")
                return {"name": req.name, "positions": values}
            if isinstance(req, P.ListPositions):
                return {"names": self.positions.list()}
            return {"name": req.name, "deleted": self.positions.delete(req.name)}
        except Unavailable as e:
            raise P.ProtocolError(P.CACHE_UNAVAILABLE, f"{e}; position lists need it (it restarts by itself)") from None

    def _cache_clear(self, ident: bytes, req: P.CacheClear) -> None:
        """Hand the clear to the compute thread: it owns L1 and the queued L2 writes, and runs it
        between jobs or decode cycles, so no generation sees a cache change under it."""
        if not self.cfg.cache:
            raise P.ProtocolError(P.CACHE_UNAVAILABLE, "the prefix cache is disabled in this daemon "
                                  "(cache = false): there is nothing to clear")
        if (ident, req.rid) in self.waiting.values():  # the client re-sent it: one answer will do
            return None
        key = f"cache_clear:{next(self._work_ids)}"  # never a job id (":" is not allowed there)
        self.waiting[key] = (ident, req.rid)
        self.compute.post(key, self.compute.clear_cache)
        return None

    def _cancel(self, job_id: str) -> Any:
        if (held := self.held.pop(job_id, None)) is not None and self.store.has_job(job_id):
            self._finish_unstarted(held)
            return P.Info(data={"job_id": job_id, "cancelled": True, "state": "cancelled"})
        job = self.jobs.cancel(job_id, "cancelled")
        if job is None:
            res = self.store.result(job_id)
            if res is None:
                raise P.ProtocolError(P.NOT_FOUND, f"no job {job_id!r}")
            return P.Info(data={"job_id": job_id, "cancelled": False, "state": _result_state(res)})
        if job.state == "cancelled":  # was still queued
            done = self._finish_unstarted(job)
            if job_id in self.watchers:
                self.compute.events.put((job_id, done))
        return P.Info(data={"job_id": job_id, "cancelled": True, "state": job.state})

    def _status(self, job_id: str) -> Any:
        self._claim(job_id)  # a client polls for it: it is wanted after all
        job = self.jobs.get(job_id)
        if job is not None:
            return P.Status(job_id=job_id, state=job.state, position=self.jobs.position(job_id), attempts=job.attempts)
        res = self.store.result(job_id)
        if res is None:
            raise P.ProtocolError(P.NOT_FOUND, f"no job {job_id!r} (unknown, or its result expired)")
        return P.Status(job_id=job_id, state=_result_state(res), result=P.current_result(res))

    def stats(self) -> dict[str, Any]:
        running = self.jobs.running
        remote = self.cache_client.stats() if self.cache_client is not None else None
        cache = caching.cache_stats(self.cfg, self.compute.prefix_cache, remote)
        cache.setdefault("l2_up", False)
        return {
            "pid": os.getpid(),
            # "ready" once loaded and warmed up (Compute._warm_up): from then on a job runs at speed
            "state": ("failed" if self.compute.load_error
                      else "ready" if self.compute.ready.is_set() else "loading"),
            "error": self.compute.load_error,
            "uptime_s": round(time.time() - self.started, 3),
            "endpoint": self.endpoint,
            "accel": accel.describe() + _pair_notes(self.compute.pair),
            "protocol": P.VERSION,
            "restarts": int(os.environ.get("DFLASH_WORKER_RESTARTS", "0")),
            "queued": self.jobs.queued_count(),
            "running": running.job_id if running else None,
            "max_queue": self.cfg.max_queue,
            "limits": {k: getattr(self.cfg, k) for k in LIMIT_FIELDS},
            "held": len(self.held),
            "job_store": self.store.notes(),  # damaged job stores moved aside and still kept
            "l2_cache": "up" if cache["l2_up"] else "down" if self.cfg.cache else "off",
            "generation": {**{k: getattr(self.cfg, k) for k in P.SAMPLING_FIELDS + P.PENALTY_FIELDS},
                           "verify_window": self.cfg.verify_window},
            **self.compute.counters,
            **self.counters,
            "cache": cache,
            "tables": self.tables(),
        }

    def tables(self) -> dict[str, int]:
        """Sizes of the worker's own tables and queues, read-only (an optional `stats` field):
        each returns to its idle size (0, `threads` to its start count) once no request is in
        flight, whatever was cancelled or disconnected on the way; scripts/soak.py and
        tests/test_soak.py watch them. `py_blocks` (Python's allocated blocks) and MLX's bytes
        are gauges: flat over a soak unless something keeps objects."""
        queue, store = self.jobs.sizes(), self.store.counts()
        return {"watchers": len(self.watchers), "held": len(self.held), "waiting": len(self.waiting),
                "queue_jobs": queue["jobs"], "queue_heap": queue["heap"],
                "events": self.compute.events.qsize(), "tasks": self.compute.tasks.qsize(),
                "store_jobs": store["jobs"], "store_results": store["results"], "store_rows": store["rows"],
                "threads": threading.active_count(), "py_blocks": sys.getallocatedblocks(), **self.compute.memory()}


_PROMPT_FIELDS = ("text", "messages", "token_ids", "system", "raw", "max_tokens", "stop")


def _plain(value: Any) -> Any:
    """A request value as the job store gives it back (tuples as lists), for comparisons."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check_list_name(name: str) -> None:
    if not 0 < len(name) <= 200:
        raise P.ProtocolError(P.BAD_REQUEST, "a position list name is 1..200 characters")


def _check_positions(positions: list[int], max_len: int, n_prompt: int | None) -> None:
    """Sparse positions: non-empty, >= 0, strictly increasing, inside the prompt when it is known."""
    def bad(msg: str) -> P.ProtocolError:
        return P.ProtocolError(P.BAD_POSITIONS, msg)

    if not positions:
        raise bad("positions is empty: select at least one prompt token")
    if len(positions) > max_len:
        raise bad(f"{len(positions)} positions exceed max_prompt_tokens={max_len}")
    if positions[0] < 0:
        raise bad(f"positions must be >= 0, got {positions[0]}")
    for i, (a, b) in enumerate(zip(positions, positions[1:])):
        if b <= a:
            raise bad(f"positions must be strictly increasing (index {i + 1}: {a} then {b})")
    if n_prompt is not None and positions[-1] >= n_prompt:
        raise bad(f"position {positions[-1]} is outside the prompt of {n_prompt} token ids")


def _result_state(res: dict) -> str:
    if res.get("type") == "error":
        return "error"
    return "cancelled" if res.get("finish_reason") == "cancelled" else "done"


def _job_row(job: Job, jobs: JobQueue) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "state": job.state,
        "priority": job.priority,
        "position": jobs.position(job.job_id),
        "attempts": job.attempts,
        "stream": job.stream,
        "max_tokens": job.request.get("max_tokens"),
    }


def _pair_notes(pair: Any) -> str:
    """The loaded pair's speed settings for the status line: few-row padding (engine/rowpad.py),
    RoPE / RMSNorm in fewer CPU kernels (engine/cpufast.py),
    draft rows per verify (engine/branches.py), cut draft blocks (engine/drafters.py), wide
    or confidence-chosen verify windows (engine/window.py) and the draft's proposal vocabulary (engine/draftvocab.py)."""
    if pair is None:
        return ""
    notes = "; few-row products padded" if pair.target.row_padding else ""
    if pair.target.cpu_fast:
        notes += "; RoPE and RMSNorm in fewer CPU kernels"
    if pair.target.fused:
        notes += "; q/k/v and gate/up as one product each"
    if pair.target.branches > 1:
        budget = pair.target.branch_budget
        notes += f"; {pair.target.branches} draft rows a greedy verify" + (
            f" (while their cache copies fit {budget // 2**20} MiB)" if budget else "")
    if pair.drafter.short_max:
        notes += f"; draft blocks cut to the window up to {pair.drafter.short_max} tokens"
    try:
        if wide_windows():
            notes += "; wide verify windows (the whole block or a plain step, by measurement)"
        elif confidence_windows():
            notes += "; greedy verify windows chosen by the draft's confidence"
    except ValueError as e:  # a bad DFLASH_WINDOW_WIDE/_CONFIDENCE: said here, refused by each generation
        notes += f"; {e}"
    n = pair.drafter.proposal_vocab
    return notes + (f"; draft proposes {draftvocab.describe(n)}" if n else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash.daemon.worker")
    ap.add_argument("--config", default=None, help="TOML file (then env vars apply)")
    ap.add_argument("--config-json", default=None, help="a fully resolved config (from the supervisor)")
    args = ap.parse_args(argv)
    # `kill -USR1 <worker pid>` writes every thread's Python stack to the log: how a stop that
    # hangs, or a job that never ends, is diagnosed on a live daemon. First, so that no moment
    # of the worker's life (loading included) is ended by the signal's default action.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    paths.private_umask()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s")
    try:
        cfg = DaemonConfig.from_json(args.config_json) if args.config_json else load_config(args.config)
        cfg.validate()
        if not cfg.model:
            raise ValueError("no model configured (set model in the config file, DFLASH_MODEL or --model)")
    except (ValueError, OSError) as e:
        log.error("bad configuration: %s", e)
        write_exit_reason(f"bad configuration: {e}")
        return 2
    accel.maybe_reexec(cfg.blas, module="dflash.daemon.worker")  # before anything imports MLX
    lifeline.hold()  # again after a re-exec (a no-op otherwise): end with the supervisor
    run_dir = paths.private_dir(cfg.runtime_path())
    lock = open(run_dir / "worker.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        log.error("another worker is running for %s", run_dir)
        write_exit_reason(f"another worker is running for {run_dir}")
        return 3
    worker = Worker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop.set())  # only sets state; the loop notices
    (run_dir / "worker.pid").write_text(str(os.getpid()))
    try:
        rc = worker.serve()
    finally:
        (run_dir / "worker.pid").unlink(missing_ok=True)
    # Skip interpreter teardown: MLX's native threads may still be winding down, and a stray
    # abort there would turn a clean shutdown (0, "do not restart") into a crash.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
