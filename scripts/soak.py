"""Soak audit of dflashd: many mixed requests through the real client; watch what grows.

    python scripts/soak.py [--requests 300] [--every 25] [--threads 3] [--model DIR --draft DIR]
                           [--out benchmark/results/soak.json] [--seed 0] [--max-tokens 24]
                           [--settle-s 6] [--smaps]

Starts a real daemon (supervisor, worker, cache process) in a private tmp dir, on a tiny
random-weight pair unless --model is given, and sends it --requests requests from --threads
client threads at once, a seeded mix of: streamed and non-streamed (detached, polled) jobs,
greedy and sampled, prompts the prefix cache has seen (hits) and new ones or `cache="bypass"`,
streams cancelled after their first delta, clients that disconnect mid-stream (a raw socket
closed without a cancel, and a `dflash-client prompt` process killed with SIGKILL), detached
jobs cancelled while queued or running, malformed frames (not msgpack, not a map, another
version, an unknown op or field, a value out of range, two frames, over the frame cap),
control calls (stats, jobs, status/cancel of unknown ids, position lists) and cache clears.

After every --every requests the load pauses until the worker is idle (nothing queued or
running, no held job) and one sample is taken of each daemon process (supervisor, worker, cache
process; pids from the runtime dir's supervisor.pid and supervisor.json): RSS, open file
descriptors by kind (/proc/PID/fd), threads, and the worker's own table sizes (`stats`
`tables`: watchers, held, waiting, queue, events, job store rows, MLX memory), the cache
process's entries, and files under the daemon's dirs. RSS is also split into anonymous, file
and shared memory (RssAnon/RssFile/RssShmem); --smaps splits it further by mapping (brk heap,
other anonymous maps such as glibc's thread arenas, libraries, each mapped file such as the job
store's SQLite database). A sample is taken a heartbeat or two after the worker goes idle, before
its idle housekeeping (IDLE_RELEASE_S, 5 s: MLX's cached buffers and glibc's free heap pages go
back to the OS) has run: --settle-s 6 samples after it instead, the memory a daemon left idle
between bursts holds. One progress line per sample. The JSON
(--out) holds the machine, the command, the series and a verdict: each metric's growth per 100
requests after the warm-up (a least-squares slope over the samples past --warmup requests) and
whether that is growth or noise. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import msgpack
import zmq

from dflash.client import DFlashClient
from dflash.client.client import make_submit
from dflash.client.errors import DFlashError
from dflash.daemon import codec
from dflash.daemon import protocol as P
from dflash.daemon.config import DaemonConfig
from dflash.daemon.supervisor import read_state

# kind -> weight in the mix (a request is one of these)
MIX = {
    "stream_greedy": 14, "stream_sampled": 8, "generate_cached": 10, "generate_bypass": 5,
    "detached": 8, "detached_cancel": 5, "cancel_midstream": 10, "socket_disconnect": 8,
    "process_killed": 4, "malformed": 12, "control": 8, "positions": 3, "cache_clear": 2,
}
SHARED = [f"You are a careful assistant. Shared context {i}: " + "the tide comes in and goes out. " * 12
          for i in range(3)]  # long prompts asked again and again: the prefix cache hits
# Metrics that grow by design, and why (the verdict names them instead of calling them leaks).
BY_DESIGN = {
    "worker.tables.store_results": "results are kept result_retention_s (here --retention-s) for status polls",
    "worker.tables.store_rows": "the job store's rows are mostly those results",
    "cache.entries": "L2 snapshots of new prompts, until a cache clear or the byte budget",
    "cache.bytes": "L2 snapshot bytes, until a cache clear or the byte budget",
    "files.state": "L2 snapshot files (diskcache keeps large values as files)",
    "l1.entries": "L1 fills up to l1_cache_entries (here --l1-entries)",
    "l1.bytes": "L1 fills up to its budgets",
    "worker.tables.mlx_active_bytes": "mostly L1's snapshots: see worker.mlx_beyond_l1_bytes",
    "worker.tables.mlx_cache_bytes": "MLX's cache of freed buffers, one per size seen; returned after 5 s idle",
    "worker.smaps.file:cache.db_rss_kb": "the job store's SQLite file, memory-mapped (diskcache: up to 64 MiB): "
                                         "its pages follow the kept results; file-backed, the kernel reclaims them",
    "cache.smaps.file:cache.db_rss_kb": "the L2 store's SQLite file, memory-mapped: follows cache.entries",
}
# Growth per 100 requests below which a gauge is noise (counts: any steady rise is growth).
THRESHOLDS = {"_kb": 1024, "bytes": 1 << 20, "py_blocks": 500}


# ---------------------------------------------------------------------------- the daemon
class Daemon:
    """A real supervisor (worker + cache process) in a private tmp dir; stopped as a group.
    `root`: the dir to run it in, which stop() leaves to the caller (scripts/gateway_soak.py keeps
    its gateway's log there too); by default a fresh one, removed by stop()."""

    def __init__(self, model: str, draft: str | None, root: Path | None = None, **settings: Any):
        self.own_dir = root is None
        # short: ipc paths are capped
        self.dir = Path(tempfile.mkdtemp(prefix="dfsoak", dir="/tmp")) if root is None else root
        self.cfg = DaemonConfig(model=model, draft=draft, runtime_dir=str(self.dir / "run"),
                                state_dir=str(self.dir / "state"), **settings)
        self.endpoint = self.cfg.resolved_endpoint()
        self.log_path = self.dir / "daemon.log"
        self.log = open(self.log_path, "wb")
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 180.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.daemon.supervisor", "--config-json",
                                      self.cfg.to_json()], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        end = time.monotonic() + wait_s
        with self.client(timeout=0.5, retry_interval=0.5) as c:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise SystemExit(f"the daemon exited early:\n{self.logs()[-3000:]}")
                try:
                    if c.stats()["state"] == "ready":
                        return
                except DFlashError:
                    pass
                time.sleep(0.2)
        raise SystemExit(f"the daemon was not ready in {wait_s:.0f}s:\n{self.logs()[-3000:]}")

    def client(self, **kw: Any) -> DFlashClient:
        return DFlashClient(self.endpoint, config=self.cfg, **kw)

    def pids(self) -> dict[str, int]:
        """supervisor, worker, cache: from the runtime dir the supervisor keeps them in."""
        run = self.cfg.runtime_path()
        out = {}
        try:
            out["supervisor"] = int((run / "supervisor.pid").read_text())
        except (OSError, ValueError):
            pass
        for name, child in read_state(run).get("children", {}).items():
            if isinstance(child, dict) and isinstance(child.get("pid"), int):
                out[name] = child["pid"]
        return out

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, keep_log: Path | None = None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        if keep_log is not None:
            shutil.copy(self.log_path, keep_log)
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------- the requests
class MixLoad:
    """A seeded, weighted mix of request kinds (those of `mix` in `kinds`, by default all) and
    what they came to: outcomes per kind, unexpected errors; `lock` guards the counts."""

    def __init__(self, mix: dict[str, int], seed: int, kinds: list[str] | None = None):
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.kinds = [k for k in mix if kinds is None or k in kinds]
        self.weights = [mix[k] for k in self.kinds]


class Load(MixLoad):
    """The request mix, run from several threads; counts outcomes per kind."""

    def __init__(self, d: Daemon, seed: int, max_tokens: int, kinds: list[str] | None = None):
        super().__init__(MIX, seed, kinds)
        self.d = d
        self.max_tokens = max_tokens
        self.rng_lock = threading.Lock()
        self.n = 0

    def pick(self) -> tuple[str, random.Random]:
        with self.rng_lock:
            self.n += 1
            return self.rng.choices(self.kinds, self.weights)[0], random.Random(self.rng.random())

    def note(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[f"{kind}:{outcome}"] += 1

    def run(self, kind: str, rng: random.Random, c: DFlashClient) -> None:
        try:
            outcome = getattr(self, kind)(rng, c)
        except DFlashError as e:
            outcome = f"error {e.code}"
        except Exception as e:  # the soak goes on; the JSON lists what failed unexpectedly
            outcome = f"exception {type(e).__name__}"
            with self.lock:
                if len(self.errors) < 50:
                    self.errors.append(f"{kind}: {type(e).__name__}: {e}")
        self.note(kind, outcome)

    def _prompt(self, rng: random.Random) -> str:
        return f"Request {rng.randrange(10**9)}: tell me about the {rng.choice(['sea', 'sky', 'moon', 'rain'])}."

    def _tokens(self, rng: random.Random) -> int:
        return rng.randint(max(1, self.max_tokens // 2), self.max_tokens)

    # --- kinds: each returns its outcome (a short word) -----------------------------------------
    def stream_greedy(self, rng: random.Random, c: DFlashClient) -> str:
        with c.stream(self._prompt(rng), max_tokens=self._tokens(rng)) as s:
            for _ in s:
                pass
            return s.result.finish_reason

    def stream_sampled(self, rng: random.Random, c: DFlashClient) -> str:
        with c.stream(self._prompt(rng), max_tokens=self._tokens(rng), temperature=0.8, top_p=0.9,
                      top_k=rng.choice([0, 20]), seed=rng.choice([None, rng.randrange(1000)])) as s:
            for _ in s:
                pass
            return s.result.finish_reason

    def generate_cached(self, rng: random.Random, c: DFlashClient) -> str:
        r = c.generate(rng.choice(SHARED) + f" Question {rng.randrange(4)}?", max_tokens=self._tokens(rng))
        return "hit" if r.stats.get("cached_prompt_tokens") else "miss"

    def generate_bypass(self, rng: random.Random, c: DFlashClient) -> str:
        r = c.generate(rng.choice(SHARED), max_tokens=self._tokens(rng), cache=rng.choice(["bypass", "refresh"]))
        return r.finish_reason

    def detached(self, rng: random.Random, c: DFlashClient) -> str:
        h = c.submit(self._prompt(rng), max_tokens=self._tokens(rng), temperature=rng.choice([0.0, 0.7]))
        return h.result(timeout=120).finish_reason

    def detached_cancel(self, rng: random.Random, c: DFlashClient) -> str:
        h = c.submit(self._prompt(rng), max_tokens=self.max_tokens * 4)
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 0.3))  # sometimes queued, sometimes running
        return h.cancel().get("state", "?")

    def cancel_midstream(self, rng: random.Random, c: DFlashClient) -> str:
        s = c.stream(self._prompt(rng), max_tokens=self.max_tokens * 8)
        try:
            for _ in s:
                break  # close() below cancels the job
        finally:
            s.close()
        return "cancelled"

    def socket_disconnect(self, rng: random.Random, c: DFlashClient) -> str:
        """A client that goes away mid-stream without a cancel: its socket is simply closed."""
        sub = make_submit(self._prompt(rng), max_tokens=self.max_tokens * 8, stream=True)
        sub.rid = 1
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.d.endpoint)
            sock.send(codec.encode(sub))
            want = rng.choice(["accepted", "delta"])  # gone while queued, or while streaming
            end = time.monotonic() + 30
            while time.monotonic() < end and sock.poll(1000):
                reply = msgpack.unpackb(sock.recv(), raw=False)
                if reply.get("type") in (want, "done", "error"):
                    return f"gone after {reply.get('type')}"
            return "no reply"
        finally:
            sock.close(0)

    def process_killed(self, rng: random.Random, c: DFlashClient) -> str:
        """`dflash-client prompt` killed with SIGKILL once it has printed some of its answer."""
        cmd = [sys.executable, "-m", "dflash.client.cli", "--endpoint", self.d.endpoint, "prompt",
               "--max-tokens", str(self.max_tokens * 8), self._prompt(rng)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            got = proc.stdout.read(1)  # streamed text: the job is running
            return "killed mid-stream" if got else "ended first"
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()

    def malformed(self, rng: random.Random, c: DFlashClient) -> str:
        big = "x" * (self.d.cfg.max_frame_bytes + 1024)
        frames = [
            [b"\xc1not msgpack"],
            [msgpack.packb([1, 2, 3])],
            [msgpack.packb({"v": P.VERSION + 7, "op": "stats", "rid": 5})],
            [msgpack.packb({"v": P.VERSION, "op": "no_such_op", "rid": 6})],
            [msgpack.packb({"v": P.VERSION, "op": "submit", "rid": 7, "text": "hi", "bogus": 1})],
            [msgpack.packb({"v": P.VERSION, "op": "submit", "rid": 8, "text": "hi", "max_tokens": 0})],
            [msgpack.packb({"v": P.VERSION, "op": "submit", "rid": 9, "text": "   "})],
            [msgpack.packb({"v": P.VERSION, "op": "submit", "rid": 10, "text": "hi", "temperature": -1.0})],
            [msgpack.packb({"v": P.VERSION, "op": "cancel", "rid": 11, "job_id": "bad id\n"})],
            [msgpack.packb({"v": P.VERSION, "op": "stats", "rid": 12}), b"extra"],
            [msgpack.packb({"v": P.VERSION, "op": "submit", "rid": 13, "text": big})],
        ]
        parts = rng.choice(frames)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.d.endpoint)
            sock.send_multipart(parts)
            if not sock.poll(10_000):
                return "no reply"
            return msgpack.unpackb(sock.recv(), raw=False).get("code", "?")
        finally:
            sock.close(0)

    def control(self, rng: random.Random, c: DFlashClient) -> str:
        op = rng.choice(["stats", "jobs", "status", "cancel", "models"])
        if op == "stats":
            c.stats()
        elif op == "jobs":
            c.jobs()
        elif op == "models":
            c.models()
        else:
            try:
                getattr(c, op)(f"nosuch{rng.randrange(10**6)}")
            except DFlashError as e:
                return f"{op} {e.code}"
        return op

    def positions(self, rng: random.Random, c: DFlashClient) -> str:
        name = f"soak-{rng.randrange(10**6)}"
        c.put_positions(name, [0, 1, 2, 5])
        c.get_positions(name)
        c.list_positions()
        return "deleted" if c.delete_positions(name) else "kept"

    def cache_clear(self, rng: random.Random, c: DFlashClient) -> str:
        return "l2 up" if c.clear_cache(timeout=60).get("l2_up") else "l2 down"


def run_batch(load: Any, n: int, threads: int, clients: list | None = None, name: str = "soak") -> None:
    """n requests from `threads` threads at once, each with a client of its own: clients[i], or
    (None) a daemon client each thread opens; `load` has pick() and run(kind, rng, client)."""
    left = [n]
    guard = threading.Lock()

    def drain(c: Any) -> None:
        while True:
            with guard:
                if left[0] <= 0:
                    return
                left[0] -= 1
            kind, rng = load.pick()
            load.run(kind, rng, c)

    def body(i: int) -> None:
        if clients is not None:
            drain(clients[i])
            return
        with load.d.client(timeout=60) as c:
            drain(c)

    ts = [threading.Thread(target=body, args=(i,), name=f"{name}-{i}") for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


# ---------------------------------------------------------------------------- sampling
def proc_sample(pid: int, shmem: bool = True, thread_names: bool = True) -> dict[str, Any]:
    """RSS (and its anonymous / file / with `shmem` shared part), open descriptors (by kind) and
    threads of one process (with `thread_names`, counted by name), from /proc."""
    rss_parts = ("RssAnon", "RssFile", "RssShmem") if shmem else ("RssAnon", "RssFile")
    out: dict[str, Any] = {"pid": pid}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "VmRSS":
                out["rss_kb"] = int(value.split()[0])
            elif key in rss_parts:
                out[key.lower().replace("rss", "rss_") + "_kb"] = int(value.split()[0])
            elif key == "Threads":
                out["threads"] = int(value)
        kinds: Counter[str] = Counter()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            kind = target.split(":")[0] if target.startswith(("socket:", "pipe:", "anon_inode:")) else "file"
            kinds[kind.replace("anon_inode", "anon")] += 1
        out["fds"] = sum(kinds.values())
        out["fd_kinds"] = dict(sorted(kinds.items()))
        if thread_names:
            names: Counter[str] = Counter()
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    names[Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()] += 1
                except OSError:
                    continue
            out["thread_names"] = dict(sorted(names.items()))
    except OSError:
        out["gone"] = True
    return out


def smaps(pid: int) -> dict[str, int]:
    """RSS by kind of mapping (/proc/PID/smaps), kB: `heap` (brk, glibc's main arena), `anon`
    (other anonymous maps: thread arenas, large mallocs, MLX buffers), `stack`, `libs` (.so text
    and data), `shmem` (SQLite's -shm wal index and other shared maps), `file:NAME` for other
    mapped files (SQLite's mmap of its database), and `anon_maps`, the number of anonymous maps.
    For --smaps: which kind of memory an RSS creep is."""
    out: Counter[str] = Counter()
    group = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header
                    path = head[5].strip() if len(head) > 5 else ""
                    if path == "[heap]":
                        group = "heap"
                    elif path.startswith("[stack"):
                        group = "stack"
                    elif not path or path.startswith("[anon"):
                        group = "anon"
                        out["anon_maps"] += 1
                    elif path.startswith("["):
                        group = "other"
                    elif ".so" in Path(path).name:
                        group = "libs"
                    elif path.startswith(("/dev/shm", "/SYSV")) or path.endswith("-shm"):
                        group = "shmem"
                    else:
                        group = "file:" + Path(path.split(" (deleted)")[0]).name
                elif head[0] == "Rss:" and group is not None:
                    out[group] += int(head[1])
    except OSError:
        return {}
    return dict(sorted(out.items()))


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def wait_idle(c: DFlashClient, timeout: float = 120.0) -> tuple[dict, bool]:
    """(The worker's stats, True) once nothing is queued, running or held and no watcher or waiter
    is left (a gone client is noticed at the next heartbeat); (the last stats read, False) when
    that does not happen in `timeout`."""
    end = time.monotonic() + timeout
    while True:
        st = c.stats()
        t = st.get("tables", {})
        idle = st["queued"] == 0 and st["running"] is None and not st.get("held") and not t.get("watchers") \
            and not t.get("waiting")
        if idle or time.monotonic() > end:
            return st, idle
        time.sleep(0.2)


def quiet_stats(d: Daemon, c: DFlashClient, timeout: float = 120.0, settle_s: float = 0.0) -> tuple[dict, bool]:
    """The worker's stats a heartbeat or two (at least `settle_s`) after it went idle, and whether
    it did within `timeout` (wait_idle)."""
    _, idle = wait_idle(c, timeout)
    time.sleep(max(2 * d.cfg.heartbeat_s, settle_s))  # a heartbeat or two: late cleanups (a gone client) land
    return c.stats(), idle


def caches(st: dict[str, Any], l2_keys: tuple[str, ...] = ("entries", "bytes", "position_lists")) -> dict[str, Any]:
    """A sample's `l1` (the worker's L1) and `cache` (the cache process's L2: `l2_keys`) from stats."""
    remote = (st.get("cache") or {}).get("l2_process") or {}
    return {"l1": {k: (st.get("cache") or {}).get("l1", {}).get(k) for k in ("entries", "bytes")},
            "cache": {k: remote.get(k) for k in l2_keys}}


def sample_head(done: int, t0: float, procs: dict[str, dict]) -> dict[str, Any]:
    """What every sample starts with: requests so far (the verdict's x), seconds since t0, the
    processes' samples."""
    return {"requests": done, "elapsed_s": round(time.monotonic() - t0, 1), "procs": procs}


def sample(d: Daemon, c: DFlashClient, done: int, t0: float, with_smaps: bool = False,
           settle_s: float = 0.0) -> dict[str, Any]:
    st, _ = quiet_stats(d, c, settle_s=settle_s)
    procs = {name: proc_sample(pid) for name, pid in d.pids().items()}
    if with_smaps:
        for name, p in procs.items():
            p["smaps"] = smaps(p["pid"])
    return {
        **sample_head(done, t0, procs),
        "tables": st.get("tables", {}),
        "worker": {k: st.get(k) for k in ("queued", "running", "held", "jobs_done", "jobs_failed", "jobs_cancelled",
                                          "frames", "bad_frames", "dropped_replies", "clients_gone", "restarts")},
        **caches(st),
        "files": {"state": count_files(d.cfg.state_path()), "runtime": count_files(d.cfg.runtime_path())},
    }


def flat_procs(s: dict[str, Any], fd_kinds: bool = False) -> dict[str, float]:
    """The sample's per-process gauges as {process.name: value}: RSS (and its parts), descriptors,
    threads, the smaps kinds when sampled, and with `fd_kinds` the descriptors of each kind."""
    out: dict[str, float] = {}
    for name, p in s["procs"].items():
        for k in ("rss_kb", "rss_anon_kb", "rss_file_kb", "rss_shmem_kb", "fds", "threads"):
            if k in p:
                out[f"{name}.{k}"] = p[k]
        out.update({f"{name}.smaps.{k}" + ("" if k == "anon_maps" else "_rss_kb"): v
                    for k, v in p.get("smaps", {}).items()})
        if fd_kinds:
            out.update({f"{name}.fd.{k}": v for k, v in p.get("fd_kinds", {}).items()})
    return out


def flat_daemon(s: dict[str, Any]) -> dict[str, float]:
    """The sample's worker tables, cache process and L1 numbers as {dotted.name: value}."""
    out: dict[str, float] = {f"worker.tables.{k}": v for k, v in s["tables"].items()}
    out.update({f"cache.{k}": v for k, v in s["cache"].items() if isinstance(v, (int, float))})
    out.update({f"l1.{k}": v for k, v in s["l1"].items() if isinstance(v, (int, float))})
    return out


def flat(s: dict[str, Any]) -> dict[str, float]:
    """The sample's numbers as {dotted.name: value}, the verdict's metrics."""
    out = flat_procs(s)
    out.update(flat_daemon(s))
    out.update({f"files.{k}": v for k, v in s["files"].items()})
    if "mlx_active_bytes" in s["tables"] and isinstance(s["l1"].get("bytes"), int):
        out["worker.mlx_beyond_l1_bytes"] = s["tables"]["mlx_active_bytes"] - s["l1"]["bytes"]
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def verdict(series: list[dict[str, Any]], warmup: int, flatten: Callable[[dict], dict[str, float]] = flat,
            by_design: dict[str, str] = BY_DESIGN, every_metric: bool = False) -> dict[str, Any]:
    """Growth per 100 requests of every metric over the samples after the warm-up. A metric
    grows when it keeps climbing: a positive least-squares slope (for gauges over THRESHOLDS:
    RSS and bytes 1 MiB per 100 requests, Python blocks 500), its last value above the highest of the first half
    of the window, and at least two rises. A one-time step (a lazily started thread: pyzmq's
    zero-copy sender in the cache process at its first large reply) is not growth.
    `flatten`: a sample's metrics ({dotted.name: value}); `by_design`: the metrics whose growth is
    named, not called a leak; `every_metric`: the metrics of every sample, sorted (by default
    those of the first sample past the warm-up, in its order)."""
    after = [s for s in series if s["requests"] >= warmup]
    if len(after) < 4:
        return {"note": "fewer than 4 samples after the warm-up: no verdict"}
    xs = [s["requests"] / 100 for s in after]
    rows = [flatten(s) for s in after]
    names = sorted({k for r in rows for k in r}) if every_metric else list(rows[0])
    out: dict[str, Any] = {"warmup_requests": warmup, "samples": len(after), "metrics": {}}
    grows, expected = [], []
    for name in names:
        ys = [r.get(name, 0) for r in rows]
        per100 = slope(xs, ys)
        early = max(ys[: len(ys) // 2])
        rises = sum(b > a for a, b in zip(ys, ys[1:]))
        limit = next((v for k, v in THRESHOLDS.items() if name.endswith(k)), 0)
        grew = per100 > limit and ys[-1] > early and rises >= 2
        out["metrics"][name] = {"per_100_requests": round(per100, 3), "first": ys[0], "last": ys[-1],
                                "max": max(ys), "grows": grew}
        if grew:
            (expected if name in by_design else grows).append(name)
    out["grows"] = grows
    out["grows_by_design"] = {n: by_design[n] for n in expected}
    out["leak_free"] = not grows
    return out


def machine(**extra: str) -> dict[str, Any]:
    """The host, its CPU, Python's and MLX's versions, and `extra` (other packages' versions)."""
    import mlx.core as mx

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "mlx": mx.__version__, "device": str(mx.default_device()),
            **extra}


def tiny_pair(root: Path) -> tuple[str, str]:
    from dflash.engine.tiny import build_draft, build_target

    build_target(root, "qwen3")
    build_draft(root / "draft", root)
    return str(root), str(root / "draft")


# ---------------------------------------------------------------------------- the run (both soaks)
def add_run_args(ap: argparse.ArgumentParser, requests: int, every: int, tiny_in: str = "a tmp dir") -> None:
    """--model, --draft, --requests, --every, --warmup and --threads, as both soaks take them."""
    ap.add_argument("--model", help=f"target (default: a tiny random qwen3 pair built in {tiny_in})")
    ap.add_argument("--draft", help="draft (default: the registry's for --model, the tiny one otherwise)")
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--every", type=int, default=every, help="requests between samples")
    ap.add_argument("--warmup", type=int, default=None,
                    help="requests before the verdict's window (default: a third of them, at least 2 samples)")
    ap.add_argument("--threads", type=int, default=3, help="client threads at once")


def parse_run_args(ap: argparse.ArgumentParser, argv: list[str] | None, script: str,
                   log_help: str) -> argparse.Namespace:
    """--out and --log added last, the command line parsed; Linux only (/proc)."""
    ap.add_argument("--out", default=None, help="JSON file for the series and the verdict")
    ap.add_argument("--log", default=None, help=log_help)
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit(f"{script} reads /proc: Linux only")
    return args


def parse_kinds(text: str | None, mix: dict[str, int]) -> list[str] | None:
    """--kinds as a list (None: the whole mix); an unknown kind ends the run."""
    kinds = text.split(",") if text else None
    if kinds and (unknown := set(kinds) - set(mix)):
        raise SystemExit(f"unknown kinds: {', '.join(sorted(unknown))}")
    return kinds


def warmup_requests(args: argparse.Namespace) -> int:
    """--warmup, by default a third of the requests and at least two samples: the first few hundred
    requests fill L1, MLX's and SQLite's caches, so growth there is warm-up."""
    return args.warmup if args.warmup is not None else max(2 * args.every, args.requests // 3)


def run_settings(args: argparse.Namespace, mix: dict[str, int], kinds: list[str], **extra: Any) -> dict[str, Any]:
    """The JSON's settings: the run's and the daemon's that both soaks take, `extra` (a script's
    own), and the mix as run (`kinds` of `mix`)."""
    return {"model": args.model or "tiny random qwen3 pair (engine/tiny.py)", "draft": args.draft,
            "requests": args.requests, "every": args.every, "threads": args.threads,
            "max_tokens": args.max_tokens, "seed": args.seed, "blas": args.blas,
            "result_retention_s": args.retention_s, "l1_cache_entries": args.l1_entries,
            **extra, "mix": {k: mix[k] for k in kinds}}


def print_verdict(v: dict[str, Any]) -> None:
    if "note" in v:
        print(f"verdict: {v['note']}")
    else:
        print(f"verdict: {'no leak' if v['leak_free'] else 'GROWS: ' + ', '.join(v['grows'])}"
              f"{'; by design: ' + ', '.join(v['grows_by_design']) if v.get('grows_by_design') else ''}")


def write_report(report: dict[str, Any], out: str | None) -> None:
    """The JSON to --out (its dir made), when given."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, requests=300, every=25)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blas", default="none", help="the daemon's blas setting (auto: MKL when installed)")
    ap.add_argument("--retention-s", type=float, default=3600.0, help="the daemon's result_retention_s")
    ap.add_argument("--kinds", default=None, help=f"comma-separated subset of the mix: {', '.join(MIX)}")
    ap.add_argument("--l1-entries", type=int, default=8,
                    help="the daemon's l1_cache_entries: small, so L1 is full after the warm-up")
    ap.add_argument("--smaps", action="store_true",
                    help="also record each process's RSS by kind of mapping (/proc/PID/smaps: heap, anon, files)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="wait this long once idle before each sample (past IDLE_RELEASE_S: idle housekeeping has run)")
    args = parse_run_args(ap, argv, "soak.py", log_help="keep the daemon's log here")
    tmp = None
    model, draft = args.model, args.draft
    if model is None:
        tmp = Path(tempfile.mkdtemp(prefix="dfsoak-tiny"))
        model, draft = tiny_pair(tmp)
    d = Daemon(model, draft, blas=args.blas, result_retention_s=args.retention_s, heartbeat_s=0.3,
               l1_cache_entries=args.l1_entries)
    series: list[dict[str, Any]] = []
    kinds = parse_kinds(args.kinds, MIX)
    load = Load(d, args.seed, args.max_tokens, kinds)
    t0 = time.monotonic()
    try:
        d.start()
        with d.client(timeout=60) as c:
            series.append(sample(d, c, 0, t0, args.smaps, args.settle_s))
            done = 0
            while done < args.requests:
                n = min(args.every, args.requests - done)
                run_batch(load, n, args.threads)
                done += n
                s = sample(d, c, done, t0, args.smaps, args.settle_s)
                series.append(s)
                w, t = s["procs"].get("worker", {}), s["tables"]
                busy = {k: v for k, v in t.items() if k in ("watchers", "held", "waiting", "queue_jobs", "queue_heap",
                                                            "events", "tasks", "store_jobs") and v}
                kinds_ = w.get("smaps") or {}
                print(f"[{s['elapsed_s']:7.1f}s] {done:5d} requests  worker rss {w.get('rss_kb', 0) / 1024:7.1f} MiB "
                      f"(anon {w.get('rss_anon_kb', 0) / 1024:.1f}, file {w.get('rss_file_kb', 0) / 1024:.1f}"
                      + (f"; heap {kinds_.get('heap', 0)} anon {kinds_.get('anon', 0)} shmem {kinds_.get('shmem', 0)} "
                         f"files {sum(v for k, v in kinds_.items() if k.startswith('file:'))} kB" if kinds_ else "")
                      + ") "
                      f"fds {w.get('fds')} threads {w.get('threads')}  "
                      f"cache fds {s['procs'].get('cache', {}).get('fds')}"
                      f"  results {t.get('store_results')}  mlx cache {t.get('mlx_cache_bytes', 0) >> 20} MiB"
                      f"  tables {busy or 'idle'}", flush=True)
    finally:
        d.stop(keep_log=Path(args.log) if args.log else None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    warmup = warmup_requests(args)
    report = {
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": run_settings(args, MIX, load.kinds),
        "outcomes": dict(sorted(load.outcomes.items())),
        "unexpected_errors": load.errors,
        "series": series,
        "verdict": verdict(series, warmup),
    }
    print_verdict(report["verdict"])
    if load.errors:
        print(f"{len(load.errors)} unexpected client errors, first: {load.errors[0]}")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
