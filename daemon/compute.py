"""The worker's single MLX thread: load the pair once, then pop a job, run the engine, emit.

Everything that touches MLX runs here (MLX streams belong to the thread that made them). It
talks to the socket thread only through the job queue and a queue of control work (in: a cache
clear) and an event queue plus a wake-up frame on an inproc socket (out), and it never lets an
exception escape a job. Control work runs between jobs and between decode cycles: never while
the engine is inside the prefix cache (lookups and inserts happen during prefill only).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import queue as _queue
import sys
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable

from dflash.cache.client import CacheClient

from . import caching
from . import protocol as P
from .config import ConfigError, DaemonConfig
from .queue import Job, JobQueue
from .store import JobStore

log = logging.getLogger("dflash.worker")
TASK_POLL_S = 0.1  # how soon an idle MLX thread picks up control work (a cache clear)
WRITES_WAIT_S = 10.0  # a clear waits this long for queued L2 writes, as a finishing job does
CLEAR_TIMEOUT_S = 30.0  # clearing a large L2 store deletes many files: more than a lookup's 1 s
IDLE_RELEASE_S = 5.0  # idle this long, the MLX thread returns MLX's cached buffers and free heap (_release_buffers)


class Compute:
    def __init__(self, cfg: DaemonConfig, jobs: JobQueue, store: JobStore, wake: Callable[[], None]):
        self.cfg = cfg
        self.jobs = jobs
        self.store = store
        self.wake = wake  # called after putting events, from this thread
        self.events: _queue.SimpleQueue[tuple[str, Any]] = _queue.SimpleQueue()
        # control work from the socket thread: (event key, work returning the Info data)
        self.tasks: _queue.SimpleQueue[tuple[str, Callable[[], dict]]] = _queue.SimpleQueue()
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.pair: Any = None
        self.prefix_cache: Any = None  # dflash.cache.tiers.PrefixCache when cfg.cache
        self.vocab_size = 0
        self.dtype: str | None = None  # the loaded weights' (or --dtype's) dtype name
        self.context_tokens = 0  # the target's context length once loaded (0: it declares none)
        # what earlier jobs' verify windows measured, greedy and sampled apart (engine/window.py)
        self.window_memory: dict[bool, Any] = {}
        self.window_key: str | None = None  # this pair's entry in <state_dir>/window_memory.json
        self.counters = {"jobs_done": 0, "jobs_failed": 0, "jobs_cancelled": 0, "tokens_generated": 0}

    # ------------------------------------------------------------------ thread body
    def run(self) -> None:
        self._load()
        if self.load_error is not None and self.cfg.exit_on_load_failure:
            self.wake()  # the worker exits 2 (Worker.serve); queued jobs stay stored for a next start
            return
        idle_since, released = time.monotonic(), True
        while True:
            self._run_tasks()
            job = self.jobs.pop(timeout=TASK_POLL_S)  # a timeout, so control work waits no longer
            if job is not None:
                try:
                    self._run_job(job)
                except Exception as e:  # its bookkeeping failed (the job store: a full disk)
                    self._bookkeeping_failed(job, e)
                idle_since, released = time.monotonic(), False
            elif self.stopping.is_set():  # queue closed (it starts no more jobs): shutting down
                return
            elif not released and time.monotonic() - idle_since >= IDLE_RELEASE_S:
                released = self._release_buffers()

    def _release_buffers(self) -> bool:
        """Give memory back once the worker has been idle a while; under load nothing changes
        (only an idle worker releases). MLX keeps every freed buffer for reuse, so a daemon that
        once prefilled a long prompt held that peak for as long as it ran: mx.clear_cache frees
        them. On Linux that alone returned nothing to the OS: MLX's CPU buffers come from glibc's
        malloc, which keeps freed chunks in its arenas with their pages resident (the soak's RSS
        was the same with and without the clear). malloc_trim hands every free page back: ~10 MiB
        per idle spell in the soak, in ~1 ms (docs/daemon.md)."""
        import mlx.core as mx

        before = rss_anon_kb()
        mx.clear_cache()
        trimmed = trim_heap()
        after = rss_anon_kb()
        if before is not None and after is not None:
            freed = before - after
            log.log(logging.INFO if freed >= 1024 else logging.DEBUG,
                    "idle: gave %.1f MiB back to the OS (MLX's cached buffers%s); anonymous RSS now %.1f MiB",
                    freed / 1024, ", malloc_trim" if trimmed else "", after / 1024)
        return True

    def stop(self) -> None:
        """End run() after the running job, which is cancelled (reason "shutdown"); queued jobs stay
        stored for the next start."""
        self.stopping.set()
        self.jobs.close()

    def _load(self) -> None:
        try:
            from dflash.engine.generate import context_tokens
            from dflash.engine.loading import load_pair, main_dtype

            pair = load_pair(self.cfg.model, self.cfg.draft, dtype=self.cfg.dtype)
            _check_window(self.cfg, pair)  # before self.pair: a pair that fails it runs no job
            self.pair = pair
            # What the weights are, not only a --dtype: with none, `models` said null (the
            # gateway's /v1/models "dtype": null) for whatever the checkpoint holds.
            self.dtype = self.cfg.dtype or main_dtype(pair.target.model)
            self.vocab_size = int(self.pair.target.vocab_size)
            self.context_tokens = context_tokens(self.pair.target)
            log.info("loaded %s with draft %s", self.pair.model_path, self.pair.draft_path)
            self._recall_windows()
            if self.cfg.cache:
                self.prefix_cache = caching.build_prefix_cache(self.cfg, self.pair)
        except Exception as e:  # the worker stays up and answers not_ready with the reason
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.load_error)
        else:
            if self.cfg.warm_up:
                self._warm_up()
        finally:
            self.ready.set()

    def _warm_up(self) -> None:
        """Run the engine's paths once before the first job, so that job does not pay their
        first calls: a fresh MLX-CUDA process compiles its kernels then (~16 s over a benchmark's
        warm-up, docs/benchmark.md), and on an H100 the first request to a fresh daemon decoded
        at 31 tok/s against 213-560 for the ones after it (session 37). A whole-block greedy run
        (the GPU's draft rows included), a sampled one and plain steps, 4 tokens each on a short
        prompt (1.3 s on a 2-core CPU for SmolLM2-135M in fp32). None of it is kept: no prefix
        cache, no window memory, no counters, no job. A failure here is logged and the worker
        serves all the same."""
        from dflash.engine.generate import stream_dflash_generate
        from dflash.engine.rollback import plain_step_undoable

        t0 = time.monotonic()
        pair = self.pair
        try:
            ids = list(pair.tokenizer.encode("Warm up: say hello, then count to ten."))
            span = 4  # the prefill's token, then a cycle: every kernel of the path has run once
            runs: list[tuple[str | int, dict]] = [
                ("full", {}), ("full", {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 0})]
            if plain_step_undoable(pair.target.make_cache()):  # plain steps, where the caches take them
                runs.append((1, {}))
            for window, sampling in runs:
                for _ in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, span,
                                                kv_bits=self.cfg.kv_bits, verify_window=window, **sampling):
                    pass
        except Exception:
            log.warning("warm-up failed (jobs run all the same): %s", traceback.format_exc())
            return
        log.info("warmed up in %.1f s (the engine's first calls, before any job)", time.monotonic() - t0)

    # ------------------------------------------------------------------ control work
    def post(self, key: str, work: Callable[[], dict]) -> None:
        """Run `work` on this thread before the next job or decode cycle; its result goes out
        as event `key`: an Info with the map it returns, or an Error."""
        self.tasks.put((key, work))

    def _run_tasks(self) -> None:
        while not self.tasks.empty():
            key, work = self.tasks.get()
            try:
                msg: Any = P.Info(data=work())
            except Exception as e:  # a bug here must not end the thread or the running job
                log.exception("control work %s failed", key)
                msg = P.Error(code=P.INTERNAL, message=f"{type(e).__name__}: {e}")
            self.events.put((key, msg))
            self.wake()

    def clear_cache(self) -> dict[str, Any]:
        """Drop every prefix snapshot, L1 then L2; position lists stay. Runs on this thread, so
        no lookup or insert is half done, and only after this cache's queued L2 writes have been
        stored (each is acknowledged: cache/writer.py), so none of them lands after the clear."""
        pc = self.prefix_cache
        l1 = {"entries": 0, "bytes": 0}
        if pc is not None:
            l1 = {"entries": len(pc.l1), "bytes": pc.l1.bytes}
            pc.drop_l1()
            if not pc.wait_writes(timeout=WRITES_WAIT_S):
                log.warning("cache clear: L2 writes still queued after %gs", WRITES_WAIT_S)
        out = {"l1": l1, **self._clear_l2()}
        log.info("prefix cache cleared: %s", out)
        return out

    def _clear_l2(self) -> dict[str, Any]:
        """Clear the cache process's snapshots, on a connection of its own (a longer timeout
        than the prefix cache's lookups take)."""
        client = CacheClient(self.cfg.resolved_cache_endpoint(), retry_after_s=0.0)
        try:
            before = client.stats()
            client.timeout_s = CLEAR_TIMEOUT_S  # deleting a large store's files takes a while
            up = before is not None and client.clear()
            after = (client.stats() or {}) if up else before
        finally:
            client.close()
        # the store's bytes include its sqlite pages, which a clear keeps: report the difference
        dropped = {k: max(0, int(before.get(k, 0)) - int(after.get(k, 0))) if up else 0 for k in ("entries", "bytes")}
        return {"l2": dropped, "l2_up": up, "position_lists": before.get("position_lists") if up else None}

    # ------------------------------------------------------------------ one job
    def _emit(self, job: Job, msg: Any) -> None:
        self.events.put((job.job_id, msg))
        self.wake()

    def _run_job(self, job: Job) -> None:
        # durable first, then visible: once a status can report attempt N the store holds N, so a
        # crash from then on counts (the other order let a kill between the two run it again)
        self.store.save(dataclasses.replace(job, attempts=job.attempts + 1))
        job.attempts += 1
        try:
            result, state = self._generate(job)
        except Exception as e:  # engine failure: fail this job, keep serving
            log.error("job %s failed: %s", job.job_id, traceback.format_exc())
            result, state = P.Error(code=P.JOB_FAILED, message=f"{type(e).__name__}: {e}", job_id=job.job_id), "error"
        if job.cancel_reason == "shutdown" and not (isinstance(result, P.Done) and result.finish_reason != "shutdown"):
            # (a job that finished on its own before the stop reached it keeps its answer)
            job.attempts -= 1  # a clean stop is not the job's fault: run it again next start
            self.store.save(job)
            self.jobs.finish(job, "queued")
            self._emit(job, P.shutdown_error(job.job_id))
            return
        self.store.finish(job.job_id, P.to_map(result))
        self.jobs.finish(job, state)
        key = {"done": "jobs_done", "cancelled": "jobs_cancelled"}.get(state, "jobs_failed")
        self.counters[key] += 1
        self._emit(job, result)

    def _bookkeeping_failed(self, job: Job, e: Exception) -> None:
        """A job whose records could not be written (the job store's disk full or read-only): it
        fails with the reason and this thread goes on. It used to die here, leaving a worker that
        still answered and sent heartbeats but never ran a job again: every client waited forever,
        even after the disk had room again. The failure is stored in place of the job's record
        when the store takes that smaller write (so `status` says it and the next start does not
        run the job again); when it does not, the record stays and the job runs again at the next
        start, as after a crash."""
        log.error("job %s: could not record it in the job store: %s", job.job_id, traceback.format_exc())
        error = P.store_error(P.JOB_FAILED, "the job", e, job_id=job.job_id)
        try:
            self.store.finish(job.job_id, P.to_map(error))
        except Exception as again:  # still full: the record stays (logged, not raised)
            log.error("job %s: its failure could not be stored either (%s): it runs again at the next start",
                      job.job_id, P.reason_line(again))
        self.jobs.finish(job, "error")
        self.counters["jobs_failed"] += 1
        self._emit(job, error)

    def _generate(self, job: Job) -> tuple[Any, str]:
        from dflash.engine.generate import Finished, stream_dflash_generate
        from dflash.engine.processors import bias_vocab_problem
        from dflash.engine.sampling import SamplingParams
        from dflash.engine.rollback import plain_step_undoable
        from dflash.engine.window import fixed_window

        if self.pair is None:
            return P.Error(code=P.NOT_READY, message=f"model not loaded: {self.load_error}", job_id=job.job_id), "error"
        req = job.request
        try:
            ids = self._prompt_ids(req)
        except ValueError as e:  # about the prompt, in whichever field the request gave it
            field = next((f for f in ("token_ids", "messages", "text") if req.get(f) is not None), "text")
            return P.Error(code=P.BAD_REQUEST, message=str(e), job_id=job.job_id, param=field), "error"
        except Exception as e:
            field = next((f for f in ("messages", "text") if req.get(f) is not None), "text")
            if self._template_args_at_fault(req):  # whatever it raised, it renders without them
                refused, field = ("the model's chat template fails with these chat template keyword arguments "
                                  f"(template_args) and renders without them: {type(e).__name__}: {e}"), "template_args"
            else:
                refused = _template_refusal(e)
            if refused is None:
                raise
            return P.Error(code=P.BAD_REQUEST, message=refused, job_id=job.job_id, param=field), "error"
        positions = req.get("positions")
        sparse: dict[str, Any] = {}
        if positions is not None:
            if positions[-1] >= len(ids):
                msg = f"position {positions[-1]} is outside the prompt of {len(ids)} tokens"
                return P.Error(code=P.BAD_POSITIONS, message=msg, job_id=job.job_id, param="positions"), "error"
            sparse = {"prompt_tokens_override": [ids[p] for p in positions], "prompt_token_positions": positions}
        policy = req.get("cache") or ("bypass" if positions is not None else "use")
        # resolved when the job was accepted (version 3); a job persisted earlier has none
        window = req.get("verify_window") or self.cfg.window()
        try:  # the engine's own rule (a count up to the draft's block), before any work
            fixed_window(window, self.pair.drafter.block_size, plain_step_undoable(self.pair.target.make_cache()))
        except ValueError as e:
            return P.Error(code=P.BAD_REQUEST, message=str(e), job_id=job.job_id, param="verify_window"), "error"

        def cancelled() -> bool:  # between prefill chunks too: a long prompt's prefill took minutes
            if job.expired():
                job.request_cancel("timeout")
            return job.cancel.is_set()

        def should_cancel() -> bool:  # between decode cycles: prefill's snapshots are all taken
            self._run_tasks()
            return cancelled()

        # Resolved when the job was accepted; a job persisted by a version-1 worker has none
        # (greedy, as that version promised).
        sampling = dict(req.get("sampling") or {})
        # accepted while the model loaded: the submit check could not see the vocabulary then
        if (problem := bias_vocab_problem(sampling.get("logit_bias"), self.vocab_size)) is not None:
            return P.Error(code=P.BAD_SAMPLING, message=problem, job_id=job.job_id, param="logit_bias"), "error"
        final = None
        for ev in stream_dflash_generate(
            self.pair.target,
            self.pair.drafter,
            self.pair.tokenizer,
            ids,
            req.get("max_tokens", 256),
            stop=req.get("stop") or (),
            kv_bits=self.cfg.kv_bits,
            should_cancel=should_cancel,
            prefill_cancel=cancelled,
            prefix_cache=caching.for_policy(self.prefix_cache, policy),
            verify_window=window,
            window_memory=self._window_memory(not sampling.get("temperature")),  # greedy or sampled
            **sampling,
            **sparse,
        ):
            if isinstance(ev, Finished):
                final = ev
            elif job.stream and (ev.text or ev.token_ids):
                self._emit(job, P.Delta(job_id=job.job_id, text=ev.text, token_ids=ev.token_ids, from_draft=ev.from_draft))
        self._keep_windows()
        if self.prefix_cache is not None:
            # Snapshots go to L2 on a writer thread; a job is reported done only once its own
            # are on their way (usually long since: they are encoded while decoding), so they
            # survive a worker that dies right after.
            self.prefix_cache.wait_writes(timeout=10.0)
        stats = final.stats.to_dict()
        reason = stats.get("finish_reason", "")
        if reason == "cancelled":  # the engine stopped at a cancel: whose (cancel, timeout, shutdown)
            reason = job.cancel_reason or reason
        # A cancel that came once the answer was complete (after its last token, before this
        # line) stops nothing: the answer keeps its own reason. It used to be relabelled
        # "cancelled" (39 of 40 cancels sent on seeing the last delta): a whole answer reported
        # as cut short, counted in jobs_cancelled, exit 6 from dflash-client.
        stats["finish_reason"] = reason
        stats["sampling"] = {**asdict(SamplingParams()), **sampling}  # the engine's defaults: greedy
        stats["verify_window"] = window
        self.counters["tokens_generated"] += len(final.token_ids)
        done = P.Done(job_id=job.job_id, text=final.text, token_ids=final.token_ids, stats=stats, finish_reason=reason)
        return done, ("cancelled" if reason == "cancelled" else "done")

    def _recall_windows(self) -> None:
        """What the last worker of this pair measured (daemon/windowstore.py)."""
        import mlx.core as mx

        from . import windowstore

        self.window_key = windowstore.pair_key(self.pair.model_path, self.pair.draft_path, self.cfg.dtype,
                                               str(mx.default_device()))
        self.window_memory = windowstore.load(self.cfg.state_path(), self.window_key)
        if self.window_memory:
            log.info("verify window: starting from %s", {("greedy" if g else "sampled"): asdict(m)
                                                          for g, m in self.window_memory.items()})

    def _keep_windows(self) -> None:
        from . import windowstore

        if self.window_key is not None:
            windowstore.save(self.cfg.state_path(), self.window_key, self.window_memory)

    def _window_memory(self, greedy: bool) -> Any:
        """One WindowMemory per decoding kind for the loaded pair: a job starts from what the
        earlier ones measured instead of exploring again (a short answer pays for that most)."""
        from dflash.engine.window import WindowMemory

        return self.window_memory.setdefault(greedy, WindowMemory())

    def _prompt_ids(self, req: dict) -> list[int]:
        from dflash.engine.generate import context_problem, prompt_ids
        from dflash.engine.prompting import build_prompt

        if req.get("token_ids") is not None:
            ids = prompt_ids(self.pair.tokenizer, req["token_ids"], self.vocab_size)
        else:
            prompt = req.get("messages") if req.get("messages") is not None else req.get("text")
            ids = build_prompt(self.pair.tokenizer, prompt, system=req.get("system"), raw=bool(req.get("raw")),
                               template_args=req.get("template_args"))
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prompt_tokens={self.cfg.max_prompt_tokens}")
        # A prompt the model's context cannot hold ran anyway (a long prefill, then an answer from
        # positions the model was never trained on, as a 200): refused, as OpenAI's API does.
        if problem := context_problem(len(ids), self.context_tokens):
            raise ValueError(problem)
        return ids

    def _template_args_at_fault(self, req: dict) -> bool:
        """Whether the request's chat template keyword arguments made its template fail: it renders
        without them. A value the template cannot use (eos_token: 1 where it adds strings) failed
        the job as job_failed, an HTTP 500, for the request's mistake rather than the model's."""
        from dflash.engine.prompting import build_prompt

        if not req.get("template_args"):
            return False
        prompt = req.get("messages") if req.get("messages") is not None else req.get("text")
        try:
            build_prompt(self.pair.tokenizer, prompt, system=req.get("system"), raw=bool(req.get("raw")))
        except Exception:
            return False
        return True

    def memory(self) -> dict[str, int]:
        """MLX's allocator: bytes in live arrays and bytes it keeps cached for reuse (0 before
        the pair loads); read from any thread, for the worker's stats."""
        if self.pair is None:
            return {"mlx_active_bytes": 0, "mlx_cache_bytes": 0}
        import mlx.core as mx

        return {"mlx_active_bytes": int(mx.get_active_memory()), "mlx_cache_bytes": int(mx.get_cache_memory())}

    def models(self) -> dict[str, Any]:
        if self.pair is None:
            return {"loaded": False, "model": self.cfg.model, "draft": self.cfg.draft, "error": self.load_error}
        return {
            "loaded": True,
            "model": self.pair.model_path,
            "draft": self.pair.draft_path,
            "block_size": self.pair.drafter.block_size,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
        }


def _template_refusal(e: BaseException) -> str | None:
    """The bad-request message for a chat template that refused the request's messages, else
    None. Many models' templates check the conversation and call raise_exception (Gemma's and
    Mistral's: "Conversation roles must alternate user/assistant/...", "System role not
    supported"); that raised jinja2's TemplateError, which ended the job as job_failed, an HTTP
    500 from the gateway, for a conversation the client got wrong. A syntax error in the model's
    own template is not the request's fault and stays a failure."""
    try:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
    except ImportError:  # transformers renders templates with jinja2; without it nothing was rendered
        return None
    if not isinstance(e, TemplateError) or isinstance(e, TemplateSyntaxError):
        return None
    return f"the model's chat template refused these messages: {e}"


def _check_window(cfg: DaemonConfig, pair: Any) -> None:
    """Refuse a configured verify window the loaded pair cannot take (the engine's rule,
    engine/window.fixed_window), so the daemon fails to start instead of blaming each request."""
    from dflash.engine.rollback import plain_step_undoable
    from dflash.engine.window import fixed_window

    try:
        fixed_window(cfg.window(), pair.drafter.block_size, plain_step_undoable(pair.target.make_cache()))
    except ValueError as e:
        raise ConfigError(f"verify_window = {cfg.verify_window} in the daemon's configuration does not "
                          f"suit this pair: {e}") from None


# ---------------------------------------------------------------------------- native heap
def _glibc_malloc_trim() -> Callable[[], int] | None:
    """glibc's malloc_trim(0) through ctypes, or None anywhere else (macOS, musl, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        fn = ctypes.CDLL(None).malloc_trim  # the process's own libc
    except (AttributeError, OSError, ValueError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


_MALLOC_TRIM = _glibc_malloc_trim()


def trim_heap() -> bool:
    """Return the free pages of every glibc malloc arena to the OS (malloc_trim(0): ~1 ms for a
    40 MB heap). True when glibc released something; False elsewhere or on failure: never raises."""
    if _MALLOC_TRIM is None:
        return False
    try:
        return bool(_MALLOC_TRIM())
    except Exception:  # a libc that misbehaves must not end the MLX thread
        log.debug("malloc_trim failed", exc_info=True)
        return False


def rss_anon_kb() -> int | None:
    """This process's anonymous resident memory (heap, arenas, MLX buffers) in kB, or None
    without /proc."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), None)
    except (OSError, ValueError, IndexError):
        return None
