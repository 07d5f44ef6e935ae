"""Soak audit of `dflash serve`: many mixed HTTP requests through a real gateway; watch what grows.

    python scripts/gateway_soak.py [--requests 600] [--every 50] [--threads 3] [--max-tokens 16]
                                   [--long-tokens 4000] [--max-queue 6] [--burst 10] [--seed 0]
                                   [--warmup N] [--kinds a,b] [--model DIR --draft DIR]
                                   [--out benchmark/results/gateway-soak.json] [--log DIR]

The gateway's twin of scripts/soak.py (which audits the daemon alone). It starts a real daemon
(supervisor, worker, cache process) in a private tmp dir, on a tiny random-weight pair unless
--model is given, and a real `dflash serve --attach` process on a free loopback port (--port 0),
then sends --requests requests from --threads client threads at once, a seeded mix of:

* the official `openai` client: chat.completions and completions, streamed and not, greedy and
  sampled (temperature, top_p, top_k, seed), with stop strings, token-id prompts, usage chunks;
  the fields this server refuses (n > 1, logprobs, best_of, echo, suffix: 400
  unsupported_parameter), an unknown model (404), a wrong key (401), models.list/retrieve;
* clients that leave: a raw socket closed after the first SSE event of a stream, or right after
  sending a request (before reading anything), or while a non-streamed answer is being made; an
  `openai` stream closed by the library after its first chunk; an `openai` call cut short by the
  library's own timeout. Each asks for --long-tokens tokens with the end-of-text tokens banned
  (logit_bias), so a job whose client left can only end by being cancelled;
* malformed requests answered by the gateway (bad JSON, wrong types, unknown fields, values out
  of range, a lone surrogate, deep nesting, a body that does not decompress, wrong method or
  route, a refused Expect), by the daemon (over max_tokens_limit, a token id past the vocabulary,
  a verify window over the block), bodies over --max-body-bytes (Content-Length, chunked,
  Expect: 100-continue) and raw bytes aiohttp's HTTP parser refuses (garbage, TLS, HTTP/2);
  bodies that stop coming (a Content-Length never reached, chunked framing broken mid-body)
  until the client leaves; fuzzed bodies (a valid request with odd values in one to three
  fields: any answer but a 5xx, checked for shape);
* several requests on one kept-alive connection (errors between them, two pipelined);
* bursts of --burst requests at once, past the daemon's queue (--max-queue): each is answered
  or refused 429 `busy` with a Retry-After (any request of the mix may meet one then);
* GET /v1/models, /metrics (text and JSON) and /health.

The first requests take each kind once, so even a short run sees every kind.

Every answer is checked: a generation's shape and finish, an error's status, OpenAI error object
and code (anything else, a 5xx above all, is an unexpected error). After every --every requests
the load pauses until the daemon is idle (nothing queued, running or held, no watcher) and a
sample is taken: the gateway process's and the daemon processes' RSS (anon/file), open
descriptors by kind, threads; the worker's tables (`stats` `tables`); the daemon's counters; the
gateway's own /metrics (answers by status, 499s: clients that left); the lines its log gained
(WARNING and worse). The gateway has no endpoint that lists its asyncio tasks, so they are not
sampled (its descriptors and threads are). Two audits of disconnects run at each sample:

* orphans: the daemon's `jobs` list is empty and `held` is 0 once idle, and every job whose
  client left and whose id is known (streams: `x-dflash-job-id`) ended `cancelled` with fewer
  tokens than it asked for;
* accounting: the daemon's jobs_done grew by exactly the number of answers clients saw finish
  (stop/length); a job that ran on to its end after its client left (a disconnect the gateway
  missed, id unknown or not) makes the difference positive.

The JSON (--out) holds the machine, the command, the settings, the outcome counts, the
unexpected errors, the series and a verdict: each metric's growth per 100 requests after the
warm-up (a least-squares slope over the samples past --warmup requests) and whether that is
growth or noise (scripts/soak.py's rule). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from dflash.client import DFlashClient

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests/helpers.load_script)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402  (the daemon soak: its Daemon, /proc sampling, verdict rule and machine facts)
from soak import Daemon, proc_sample  # noqa: E402

KEY = "sk-gateway-soak"
# kind -> weight in the mix (a request is one of these)
MIX = {
    "chat": 12, "chat_stream": 10, "completion": 7, "completion_stream": 6, "unsupported": 4,
    "stream_disconnect": 7, "early_disconnect": 5, "wait_disconnect": 4, "stream_close": 5,
    "client_timeout": 4, "malformed": 12, "oversized": 3, "garbage": 5, "unknown_model": 2,
    "bad_key": 2, "info": 8, "keepalive": 4, "burst": 2, "fuzz": 10,
    "stalled_body": 3,
}
# What a leaving client leaves behind: its job must be cancelled (they ask for --long-tokens).
DISCONNECTS = ("stream_disconnect", "early_disconnect", "wait_disconnect", "stream_close", "client_timeout")
PROMPTS = ["tell me about the sea", "why is the sky blue", "write a short poem about rain",
           "what is the capital of France", "count from one to ten"]
SHARED = "You are a careful assistant. " + "The tide comes in and goes out. " * 10  # prefix-cache hits
STOPS = ["the", "e", ".", "\n", "sea"]
# Metrics that grow by design, and why (the verdict names them instead of calling them leaks):
# scripts/soak.py's that a gateway soak samples.
BY_DESIGN = {k: v for k, v in soak.BY_DESIGN.items()
             if k in ("worker.tables.store_results", "worker.tables.store_rows", "cache.entries", "cache.bytes",
                      "l1.entries", "l1.bytes", "worker.tables.mlx_active_bytes", "worker.tables.mlx_cache_bytes")}
BY_DESIGN["worker.tables.mlx_active_bytes"] = "mostly L1's snapshots"
# Gateway log lines that are answers working as designed, not findings.
LOG_BENIGN = ("answered as HTTP",)  # a daemon message with a path redacted: the full one is logged


class Unexpected(Exception):
    """An answer the gateway should not have given (wrong status, shape, code, or a 5xx)."""


class Busy(Exception):
    """A 429 `busy` (the daemon's queue was full, --max-queue) with its Retry-After: an answer."""


def check_busy(status: int, headers: dict[str, str], body: bytes) -> None:
    """Raise Busy for a proper 429 (OpenAI's error object, code busy, a Retry-After)."""
    if status == 429:
        err = error_object(status, headers, body)
        if err["code"] != "busy" or "retry-after" not in headers:
            raise Unexpected(f"429 {err['code']} (Retry-After {headers.get('retry-after')})")
        raise Busy()


# ---------------------------------------------------------------------------- the processes
class Gateway:
    """A real `dflash serve --attach` process on a free loopback port."""

    def __init__(self, d: Daemon, max_body_bytes: int, default_max_tokens: int):
        self.max_body_bytes = max_body_bytes
        self.log_path = d.dir / "gateway.log"
        self.log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "dflash.engine.cli", "serve", "--attach", "--port", "0",
               "--endpoint", d.endpoint, "--runtime-dir", d.cfg.runtime_dir, "--state-dir", d.cfg.state_dir,
               "--api-key", KEY, "--served-model-name", "soak", "--max-body-bytes", str(max_body_bytes),
               "--default-max-tokens", str(default_max_tokens)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        end, line = time.monotonic() + 60, b""
        while time.monotonic() < end and b"listening on" not in line:
            if self.proc.poll() is not None:
                raise SystemExit(f"the gateway exited {self.proc.returncode}:\n{self.logs()[-3000:]}")
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline()
        if b"listening on" not in line:
            self.proc.kill()
            self.proc.wait(5)
            raise SystemExit(f"the gateway did not listen in 60 s:\n{self.logs()[-3000:]}")
        self.url = line.split(b"listening on ")[1].split()[0].decode()
        self.port = int(self.url.rsplit(":", 1)[1])
        self.log_seen = 0  # bytes of its log already looked at

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")  # written by the process itself

    def new_log_lines(self) -> list[str]:
        text = self.logs()
        new, self.log_seen = text[self.log_seen:], len(text)
        return [ln for ln in new.splitlines() if ln.strip()]

    def stop(self) -> int | None:
        """SIGTERM (as Ctrl-C would); its exit status, None if it had to be killed."""
        rc = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                rc = self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        else:
            rc = self.proc.returncode
        self.proc.stdout.close()
        self.log.close()
        return rc


# ---------------------------------------------------------------------------- raw HTTP
def http_bytes(method: str, path: str, body: bytes | None = b"", headers: dict | None = None) -> bytes:
    h = {"Host": "127.0.0.1", "Connection": "close", "Authorization": f"Bearer {KEY}",
         "Content-Type": "application/json", **(headers or {})}
    if body is not None and "Transfer-Encoding" not in h:
        h.setdefault("Content-Length", str(len(body)))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return head.encode() + b"\r\n" + (body or b"")


def exchange(port: int, data: bytes, timeout: float = 60.0) -> bytes:
    """Send bytes on a fresh connection, read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def parse_http(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, lower-cased headers and body (de-chunked) of one HTTP/1.x answer."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise Unexpected(f"not an HTTP answer: {reply[:120]!r}") from None
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while body:
            size, _, body = body.partition(b"\r\n")
            n = int(size.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out, body = out + body[:n], body[n + 2:]
        body = out
    return status, headers, body


def read_whole(sock: socket.socket, got: bytes, timeout: float = 30.0) -> bytes:
    """The rest of one answer whose first bytes are `got`: up to its Content-Length, the end of its
    chunks, or the connection's close (a kept-alive connection stays open after an answer)."""
    sock.settimeout(timeout)
    while True:
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            length = next((int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n")
                           if ln.lower().startswith(b"content-length:")), None)
            if (length is not None and len(body) >= length) or body.endswith(b"0\r\n\r\n"):
                return got
        chunk = sock.recv(65536)
        if not chunk:
            return got
        got += chunk


def read_answer(f: Any) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer read from a kept-alive connection's file (Content-Length or chunked)."""
    line = f.readline()
    try:
        status = int(line.split()[1])
    except (IndexError, ValueError):
        raise Unexpected(f"not an HTTP answer: {line[:120]!r}") from None
    headers: dict[str, str] = {}
    while (h := f.readline()) not in (b"\r\n", b""):
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (n := int(f.readline().split(b";")[0] or b"0", 16)) > 0:
            body += f.read(n)
            f.readline()
        f.readline()
    else:
        body = f.read(int(headers.get("content-length", "0")))
    return status, headers, body


def error_object(status: int, headers: dict[str, str], body: bytes) -> dict:
    """The OpenAI error object of an answer, checked for its exact shape and JSON type."""
    if not headers.get("content-type", "").startswith("application/json"):
        raise Unexpected(f"{status} answered as {headers.get('content-type')!r}: {body[:200]!r}")
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        raise Unexpected(f"{status} without an error object: {body[:200]!r}") from None
    if not (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and err["message"]):
        raise Unexpected(f"{status} with a malformed error object: {err!r}")
    return err


def sse_head(sock: socket.socket, deadline: float) -> tuple[dict[str, str], bytes]:
    """Read a streamed answer up to its headers and first SSE event: (headers, what was read)."""
    buf = b""
    while b"\r\n\r\n" not in buf or b"data: " not in buf.partition(b"\r\n\r\n")[2]:
        if time.monotonic() > deadline:
            raise Unexpected(f"no first event in time: {buf[:200]!r}")
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep and not head.startswith(b"HTTP/1.1 200"):  # an error answer (kept alive): read it whole
            status, headers, _ = parse_http(head + sep)
            while len(rest) < int(headers.get("content-length", "0")):
                if not (chunk := sock.recv(65536)):
                    break
                rest += chunk
            check_busy(status, headers, rest)  # the queue was full: an answer
            raise Unexpected(f"stream answered {status}: {rest[:300]!r}")
        chunk = sock.recv(65536)
        if not chunk:
            raise Unexpected(f"the stream closed before its first event: {buf[:300]!r}")
        buf += chunk
    status, headers, _ = parse_http(buf.partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
    if status != 200:
        raise Unexpected(f"stream answered {status}: {buf[:300]!r}")
    return headers, buf


# Requests the gateway itself refuses: (name, method, path, body, headers, status, code).
def _deep(n: int) -> bytes:
    return b'{"messages": ' + b"[" * n + b"]" * n + b"}"


MALFORMED: list[tuple[str, str, str, bytes | None, dict, int, str | None]] = [
    ("bad json", "POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
    ("not utf-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, "invalid_json"),
    ("lone surrogate", "POST", "/v1/completions", b'{"prompt": "a\\ud800b"}', {}, 400, "invalid_json"),
    ("deep nesting", "POST", "/v1/chat/completions", _deep(200), {}, 400, "invalid_json"),
    ("body a list", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_type"),
    ("empty body", "POST", "/v1/completions", b"", {}, 400, "invalid_json"),
    ("messages a string", "POST", "/v1/chat/completions", b'{"messages": "hi"}', {}, 400, "invalid_type"),
    ("no messages", "POST", "/v1/chat/completions", b'{"model": "soak"}', {}, 400, "missing_required_parameter"),
    ("max_tokens a string", "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', {}, 400,
     "invalid_type"),
    ("max_tokens 0", "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 0}', {}, 400, "invalid_value"),
    ("temperature -1", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', {}, 400, "invalid_value"),
    ("top_p a string", "POST", "/v1/completions", b'{"prompt": "x", "top_p": "high"}', {}, 400, "invalid_type"),
    ("stream not a bool", "POST", "/v1/completions", b'{"prompt": "x", "stream": "yes"}', {}, 400, "invalid_type"),
    ("unknown field", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}', {}, 400, "unknown_parameter"),
    ("unknown role", "POST", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', {},
     400, "invalid_value"),
    ("tool message", "POST", "/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}]}', {}, 400,
     "unsupported_parameter"),
    ("blank prompt", "POST", "/v1/completions", b'{"prompt": "   "}', {}, 400, "invalid_value"),
    ("negative token id", "POST", "/v1/completions", b'{"prompt": [-1], "max_tokens": 2}', {}, 400, "invalid_value"),
    ("logit_bias key", "POST", "/v1/completions", b'{"prompt": "x", "logit_bias": {"abc": 1}}', {}, 400,
     "invalid_value"),
    ("stop list of ints", "POST", "/v1/completions", b'{"prompt": "x", "stop": [1, 2]}', {}, 400, "invalid_type"),
    ("verify_window word", "POST", "/v1/completions", b'{"prompt": "x", "verify_window": "wide"}', {}, 400,
     "invalid_value"),
    ("broken gzip", "POST", "/v1/completions", b"not gzip at all", {"Content-Encoding": "gzip"}, 400,
     "invalid_body"),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, None),
    ("unknown route", "GET", "/v2/nothing", None, {}, 404, None),
    ("refused Expect", "POST", "/v1/completions", b"{}", {"Expect": "teapot"}, 417, "expectation_failed"),
    # what only the daemon can check: refused at its submit, or as the job starts
    ("over max_tokens_limit", "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 1000000}', {}, 400,
     "bad_request"),
    ("token id past the vocabulary", "POST", "/v1/completions", b'{"prompt": [1000000], "max_tokens": 2}', {}, 400,
     "bad_request"),
    ("verify_window over the block", "POST", "/v1/completions",
     b'{"prompt": "x", "max_tokens": 2, "verify_window": 99}', {}, 400, "bad_request"),
    ("a gzip body, fine", "POST", "/v1/completions", gzip.compress(b'{"prompt": "x", "max_tokens": 2}'),
     {"Content-Encoding": "gzip"}, 200, None),
]
# Bytes aiohttp's HTTP parser refuses before any route runs: 400 invalid_http, connection closed.
GARBAGE = [
    b"GARBAGE\r\n\r\n",
    b"G@T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS ClientHello
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
]


# Fuzzed bodies: a valid request with one to three fields set to any of these (JSON's NaN and
# Infinity included, as Python's json writes them); any answer but a 5xx is fine, checked for shape.
FUZZ_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
               "stop", "temperature", "top_p", "top_k", "seed", "min_p", "min_tokens_to_keep", "logit_bias",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
               "presence_context_size", "frequency_context_size", "n", "best_of", "logprobs", "top_logprobs",
               "echo", "suffix", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "tools",
               "tool_choice", "functions", "function_call", "response_format", "chat_template_kwargs",
               "verify_window", "no_such_field"]
FUZZ_VALUES: list[Any] = [None, True, False, 0, 1, 2, -1, 7.0, 0.5, -0.0, 1e308, 2**64, 2**70, -2**63,
                          float("nan"), float("inf"), float("-inf"), "", "x", "auto", "full", "soak", "\x00",
                          "\ud800", "a" * 300, [], [1, 2], ["x"], [[1]], [None], {}, {"a": 1}, {"1": 5},
                          {"include_usage": True}, {"include_usage": "yes"}, {"type": "text"},
                          {"enable_thinking": False}, {"tokenize": True},
                          [{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text",
                                                                                           "text": "hi"}]}],
                          [{"role": "user"}], [{"content": "hi"}], [{"role": "assistant", "content": None}],
                          [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]]


# ---------------------------------------------------------------------------- the requests
class Load(soak.MixLoad):
    """The request mix, run from several threads; counts outcomes per kind and what clients saw."""

    def __init__(self, g: Gateway, seed: int, max_tokens: int, long_tokens: int, vocab: int, eos: list[int],
                 kinds: list[str] | None = None, burst_size: int = 10):
        super().__init__(MIX, seed, kinds)
        self.g = g
        self.burst_size = burst_size
        self.max_tokens = max_tokens
        self.long_tokens = long_tokens
        self.vocab = vocab
        self.ban_eos = {str(t): -100 for t in eos}  # a leaving client's job can only end by a cancel
        self.n_errors = 0
        self.finished_seen = 0  # answers whose finish a client saw (jobs_done must grow by this)
        self.left_jobs: list[tuple[str, str]] = []  # (kind, job id) of jobs whose client left
        self.model = "soak"
        self.picked = 0

    def pick(self) -> tuple[str, random.Random]:
        """The next request's kind: each kind once, in order (a short run sees them all), then
        drawn by weight; and a generator of its own, seeded from the run's."""
        with self.lock:
            self.picked += 1
            if self.picked <= len(self.kinds):
                kind = self.kinds[self.picked - 1]
            else:
                kind = self.rng.choices(self.kinds, self.weights)[0]
            return kind, random.Random(self.rng.random())

    def unexpected(self, text: str) -> None:
        with self.lock:
            self.n_errors += 1
            if len(self.errors) < 100:
                self.errors.append(text)

    def run(self, kind: str, rng: random.Random, c: openai.OpenAI) -> None:
        try:
            outcome = getattr(self, kind)(rng, c)
        except Unexpected as e:
            outcome = "UNEXPECTED"
            self.unexpected(f"{kind}: {e}")
        except Busy:
            outcome = "429 busy"
        except openai.RateLimitError as e:
            outcome = "429 busy"
            if e.code != "busy" or "retry-after" not in e.response.headers:
                outcome = "UNEXPECTED 429"
                self.unexpected(f"{kind}: 429 {e.code} (Retry-After {e.response.headers.get('retry-after')})")
        except openai.APIStatusError as e:
            outcome = f"UNEXPECTED {e.status_code}"
            self.unexpected(f"{kind}: HTTP {e.status_code}: {e.message}")
        except Exception as e:  # the soak goes on; the JSON lists what failed unexpectedly
            outcome = f"UNEXPECTED {type(e).__name__}"
            self.unexpected(f"{kind}: {type(e).__name__}: {e}")
        with self.lock:
            self.outcomes[f"{kind}:{outcome}"] += 1

    def saw_finish(self) -> None:
        with self.lock:
            self.finished_seen += 1

    def left(self, kind: str, job_id: str | None) -> None:
        if job_id:
            with self.lock:
                self.left_jobs.append((kind, job_id))

    # --- request pieces ---------------------------------------------------------------------------
    def _tokens(self, rng: random.Random) -> int:
        return rng.randint(max(1, self.max_tokens // 4), self.max_tokens)

    def _messages(self, rng: random.Random) -> list[dict]:
        msgs = [{"role": "user", "content": f"Request {rng.randrange(10**6)}: {rng.choice(PROMPTS)}."}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": rng.choice(["system", "developer"]), "content": SHARED})
        return msgs

    def _prompt(self, rng: random.Random) -> str | list[int]:
        if rng.random() < 0.25:
            return [rng.randrange(4, min(self.vocab, 300)) for _ in range(rng.randint(1, 12))]
        shared = SHARED if rng.random() < 0.3 else ""
        return shared + f"Once upon a time {rng.randrange(10**6)}, {rng.choice(PROMPTS)}"

    def _sampling(self, rng: random.Random) -> tuple[dict, dict, str]:
        """Keyword arguments, extra_body and the outcome's word: greedy or sampled, maybe stops."""
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        how = "greedy"
        if rng.random() < 0.45:
            how = "sampled"
            kw.update(temperature=rng.choice([0.5, 0.8, 1.2]), top_p=rng.choice([0.9, 1.0]))
            if rng.random() < 0.5:
                kw["seed"] = rng.randrange(10**6)
            if rng.random() < 0.3:
                extra["top_k"] = rng.choice([5, 40])
            if rng.random() < 0.2:
                extra["min_p"] = 0.05
        if rng.random() < 0.3:
            kw["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.1:
            kw["frequency_penalty"] = 0.5
        return kw, extra, how

    def _check_finish(self, reason: str | None, completion_tokens: int | None, max_tokens: int) -> str:
        if reason not in ("stop", "length"):
            raise Unexpected(f"finish_reason {reason!r}")
        if completion_tokens is not None and (completion_tokens > max_tokens
                                              or (reason == "length" and completion_tokens != max_tokens)):
            raise Unexpected(f"{completion_tokens} tokens for max_tokens {max_tokens} ({reason})")
        self.saw_finish()
        return reason

    # --- kinds: each returns its outcome (a short word) ------------------------------------------
    def chat(self, rng: random.Random, c: openai.OpenAI) -> str:
        kw, extra, how = self._sampling(rng)
        n = self._tokens(rng)
        mt = {"max_tokens": n} if rng.random() < 0.5 else {"max_completion_tokens": n}
        r = c.chat.completions.create(model=self.model, messages=self._messages(rng), extra_body=extra or None,
                                      **mt, **kw)
        if r.object != "chat.completion" or not r.id.startswith("chatcmpl-") or len(r.choices) != 1:
            raise Unexpected(f"not a chat.completion: {r!r}"[:300])
        if r.choices[0].message.role != "assistant" or not isinstance(r.choices[0].message.content, str):
            raise Unexpected(f"bad message: {r.choices[0].message!r}")
        reason = self._check_finish(r.choices[0].finish_reason, r.usage.completion_tokens, n)
        return f"{how} {reason}"

    def chat_stream(self, rng: random.Random, c: openai.OpenAI) -> str:
        kw, extra, how = self._sampling(rng)
        n = self._tokens(rng)
        usage = rng.random() < 0.5
        chunks = list(c.chat.completions.create(model=self.model, messages=self._messages(rng), max_tokens=n,
                                                stream=True, extra_body=extra or None,
                                                stream_options={"include_usage": True} if usage else None, **kw))
        if not chunks or chunks[0].choices[0].delta.role != "assistant":
            raise Unexpected(f"the stream did not open with the role: {chunks[:1]!r}")
        return self._stream_end(chunks, usage, n, how)

    def _stream_end(self, chunks: list, usage: bool, n: int, how: str) -> str:
        finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        if len(finals) != 1 or len({ch.id for ch in chunks}) != 1:
            raise Unexpected(f"finishes {finals}, ids {len({ch.id for ch in chunks})}")
        tokens = None
        if usage:
            if chunks[-1].choices or chunks[-1].usage is None:
                raise Unexpected("no usage chunk at the end")
            tokens = chunks[-1].usage.completion_tokens
        return f"{how} {self._check_finish(finals[0], tokens, n)}"

    def completion(self, rng: random.Random, c: openai.OpenAI) -> str:
        kw, extra, how = self._sampling(rng)
        n = self._tokens(rng)
        r = c.completions.create(model=self.model, prompt=self._prompt(rng), max_tokens=n, extra_body=extra or None,
                                 **kw)
        if r.object != "text_completion" or not r.id.startswith("cmpl-") or not isinstance(r.choices[0].text, str):
            raise Unexpected(f"not a text_completion: {r!r}"[:300])
        return f"{how} {self._check_finish(r.choices[0].finish_reason, r.usage.completion_tokens, n)}"

    def completion_stream(self, rng: random.Random, c: openai.OpenAI) -> str:
        kw, extra, how = self._sampling(rng)
        n = self._tokens(rng)
        usage = rng.random() < 0.5
        chunks = list(c.completions.create(model=self.model, prompt=self._prompt(rng), max_tokens=n, stream=True,
                                           extra_body=extra or None,
                                           stream_options={"include_usage": True} if usage else None, **kw))
        return self._stream_end(chunks, usage, n, how)

    def unsupported(self, rng: random.Random, c: openai.OpenAI) -> str:
        """What this server refuses (one choice per request, no logprobs): a 400 naming the field."""
        msgs = self._messages(rng)
        name, call = rng.choice([
            ("n", lambda: c.chat.completions.create(model=self.model, messages=msgs, max_tokens=2, n=2)),
            ("logprobs", lambda: c.chat.completions.create(model=self.model, messages=msgs, max_tokens=2,
                                                           logprobs=True)),
            ("top_logprobs", lambda: c.chat.completions.create(model=self.model, messages=msgs, max_tokens=2,
                                                               top_logprobs=3)),
            ("logprobs", lambda: c.completions.create(model=self.model, prompt="x", max_tokens=2, logprobs=2)),
            ("best_of", lambda: c.completions.create(model=self.model, prompt="x", max_tokens=2, best_of=3)),
            ("echo", lambda: c.completions.create(model=self.model, prompt="x", max_tokens=2, echo=True)),
            ("suffix", lambda: c.completions.create(model=self.model, prompt="x", max_tokens=2, suffix="end")),
        ])
        try:
            call()
        except openai.BadRequestError as e:
            if e.code != "unsupported_parameter" or e.param != name:
                raise Unexpected(f"{name}: 400 {e.code} param {e.param}") from None
            return f"400 {name}"
        raise Unexpected(f"{name} was accepted")

    def unknown_model(self, rng: random.Random, c: openai.OpenAI) -> str:
        try:
            if rng.random() < 0.5:
                c.chat.completions.create(model=f"gpt-{rng.randrange(10)}", messages=self._messages(rng), max_tokens=2)
            else:
                c.models.retrieve(f"nosuch-{rng.randrange(100)}")
        except openai.NotFoundError as e:
            if e.code != "model_not_found":
                raise Unexpected(f"404 code {e.code}") from None
            return "404"
        raise Unexpected("an unknown model was served")

    def bad_key(self, rng: random.Random, c: openai.OpenAI) -> str:
        wrong = c.with_options(api_key=rng.choice(["sk-wrong", "x" * 300, "é"]))
        try:
            wrong.models.list() if rng.random() < 0.5 else wrong.completions.create(model=self.model, prompt="x",
                                                                                   max_tokens=2)
        except openai.AuthenticationError as e:
            if e.code != "invalid_api_key":
                raise Unexpected(f"401 code {e.code}") from None
            return "401"
        except UnicodeEncodeError:  # the client itself refuses a key that is not ASCII
            return "refused by the client"
        raise Unexpected("a wrong key was let in")

    def info(self, rng: random.Random, c: openai.OpenAI) -> str:
        what = rng.choice(["models", "model", "metrics", "metrics json", "health"])
        if what == "models":
            ids = [m.id for m in c.models.list().data]
            if ids != [self.model]:
                raise Unexpected(f"models {ids}")
        elif what == "model":
            if c.models.retrieve(self.model).owned_by != "dflash":
                raise Unexpected("models.retrieve")
        else:
            path = {"metrics": "/metrics", "metrics json": "/metrics?format=json", "health": "/health"}[what]
            headers = {"Authorization": None} if what == "health" else {}  # health needs no key
            status, h, body = parse_http(exchange(self.g.port, http_bytes("GET", path, None, headers)))
            if status != 200:
                raise Unexpected(f"{path}: {status} {body[:200]!r}")
            if what == "metrics" and b"dflash_daemon_up 1" not in body:
                raise Unexpected("/metrics without dflash_daemon_up 1")
            if what != "metrics" and not isinstance(json.loads(body), dict):
                raise Unexpected(f"{path}: {body[:200]!r}")
        return what

    def malformed(self, rng: random.Random, c: openai.OpenAI) -> str:
        name, method, path, body, headers, want, code = rng.choice(MALFORMED)
        status, h, raw = parse_http(exchange(self.g.port, http_bytes(method, path, body, headers)))
        check_busy(status, h, raw)
        if want == 200:
            if status != 200:
                raise Unexpected(f"{name}: {status} {raw[:200]!r}")
            self._check_finish(json.loads(raw)["choices"][0]["finish_reason"], None, 2)
            return "200"
        err = error_object(status, h, raw)
        if (status, err["code"]) != (want, code):
            raise Unexpected(f"{name}: {status} {err['code']} (wanted {want} {code}): {err['message'][:200]}")
        return f"{status} {code or ''}".strip()

    def oversized(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A body over --max-body-bytes: declared, chunked (no length), or held back behind Expect."""
        big = json.dumps({"prompt": "x" * (self.g.max_body_bytes + rng.randrange(1, 4096)), "max_tokens": 2}).encode()
        how = rng.choice(["content-length", "chunked", "expect"])
        if how == "content-length":
            data = http_bytes("POST", "/v1/completions", big)
        elif how == "chunked":
            step = 8192
            body = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + step]), big[i:i + step]) for i in range(0, len(big), step))
            data = http_bytes("POST", "/v1/completions", body + b"0\r\n\r\n", {"Transfer-Encoding": "chunked"})
        else:  # the client waits for 100 Continue; the server answers 413 at once instead
            data = http_bytes("POST", "/v1/completions", None, {"Expect": "100-continue",
                                                                 "Content-Length": str(len(big))})
        try:
            status, h, raw = parse_http(exchange(self.g.port, data))
        except ConnectionResetError:
            raise Unexpected(f"{how}: the connection was reset before the 413 could be read") from None
        err = error_object(status, h, raw)
        if (status, err["code"]) != (413, "body_too_large"):
            raise Unexpected(f"{how}: {status} {err['code']}")
        return f"413 {how}"

    def garbage(self, rng: random.Random, c: openai.OpenAI) -> str:
        data = rng.choice(GARBAGE + [b"\x00" + rng.randbytes(rng.randint(1, 300))])
        try:
            status, h, raw = parse_http(exchange(self.g.port, data))
        except ConnectionResetError:
            raise Unexpected(f"reset instead of a 400 for {data[:40]!r}") from None
        err = error_object(status, h, raw)
        if (status, err["code"]) != (400, "invalid_http"):
            raise Unexpected(f"garbage {data[:40]!r}: {status} {err['code']}")
        return "400 invalid_http"

    def keepalive(self, rng: random.Random, c: openai.OpenAI) -> str:
        """Several requests on one kept-alive connection: an error answer (a 400 in JSON) does not
        end it, and the next request on it is served."""
        steps = [("GET", "/v1/models", None, 200),
                 ("POST", "/v1/completions", b"{broken", 400),
                 ("POST", "/v1/chat/completions", json.dumps({"messages": self._messages(rng), "max_tokens": 2,
                                                              "temperature": -3}).encode(), 400),
                 ("POST", "/v1/completions", json.dumps({"prompt": self._prompt(rng), "max_tokens": 3}).encode(), 200)]
        rng.shuffle(steps)
        with socket.create_connection(("127.0.0.1", self.g.port), timeout=60) as s:
            f = s.makefile("rb")
            for method, path, body, want in steps:
                s.sendall(http_bytes(method, path, body, {"Connection": None}))
                status, headers, raw = read_answer(f)
                check_busy(status, headers, raw)
                if status != want:
                    raise Unexpected(f"{method} {path} on a kept-alive connection: {status} {raw[:200]!r}")
                if want == 400:
                    error_object(status, headers, raw)
                elif path == "/v1/completions":
                    self._check_finish(json.loads(raw)["choices"][0]["finish_reason"], None, 3)
                if headers.get("connection", "").lower() == "close":
                    raise Unexpected(f"{method} {path} ({status}) closed a kept-alive connection")
            # pipelined: two requests in one write, answered in order
            s.sendall(http_bytes("GET", "/v1/models/soak", None, {"Connection": None})
                      + http_bytes("GET", "/v1/models/nosuch", None, {"Connection": None}))
            first, second = read_answer(f), read_answer(f)
            if (first[0], second[0]) != (200, 404) or json.loads(first[2]).get("id") != self.model:
                raise Unexpected(f"pipelined: {first[0]} {first[2][:100]!r}, {second[0]} {second[2][:100]!r}")
            error_object(*second)
        return "5 on one connection, 2 pipelined"

    def burst(self, rng: random.Random, c: openai.OpenAI) -> str:
        """--burst short requests at once, more than the daemon's queue takes (--max-queue): each
        is answered, or refused with 429 busy and a Retry-After."""
        def one(seed: float) -> str:
            r = random.Random(seed)
            try:
                out = c.chat.completions.create(model=self.model, messages=self._messages(r), max_tokens=4)
            except openai.RateLimitError as e:
                if e.code != "busy" or "retry-after" not in e.response.headers:
                    raise Unexpected(f"429 {e.code}") from None
                return "busy"
            self._check_finish(out.choices[0].finish_reason, out.usage.completion_tokens, 4)
            return "ok"

        c = openai.OpenAI(base_url=self.g.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:  # a client of its own, closed after: its pool's kept-alive connections go with it
            with ThreadPoolExecutor(self.burst_size) as pool:
                got = Counter(pool.map(one, [rng.random() for _ in range(self.burst_size)]))
        finally:
            c.close()
        return "some 429" if got["busy"] else "all served"

    def fuzz(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A valid request with one to three fields set to odd values: a 4xx in OpenAI's shape or
        an answer, never a 5xx; never a long job (its max_tokens stay small or invalid)."""
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"model": self.model, "max_tokens": 4}
        if chat:
            body["messages"] = self._messages(rng)
        else:
            body["prompt"] = self._prompt(rng)
        for name in rng.sample(FUZZ_FIELDS, rng.randint(1, 3)):
            body[name] = rng.choice(FUZZ_VALUES)
            if name in ("max_tokens", "max_completion_tokens") and isinstance(body[name], int) \
                    and not isinstance(body[name], bool) and 8 < body[name] < 2**63:
                body[name] = 4
        data = json.dumps(body).encode()  # NaN and Infinity as Python's json writes them
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, h, raw = parse_http(exchange(self.g.port, http_bytes("POST", path, data)))
        check_busy(status, h, raw)
        if status >= 500 or status not in (200, 400, 404, 413):
            raise Unexpected(f"{status} for {data[:300]!r}: {raw[:300]!r}")
        if status != 200:
            err = error_object(status, h, raw)
            return f"{status} {err['code']}"
        if h.get("content-type", "").startswith("text/event-stream"):
            events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                raise Unexpected(f"a stream without [DONE]: {raw[-300:]!r}")
            for ev in events[:-1]:
                obj = json.loads(ev)
                if "error" in obj:
                    raise Unexpected(f"a stream that ended in an error for {data[:300]!r}: {ev[:300]}")
                reason = obj["choices"][0]["finish_reason"] if obj.get("choices") else None
                if reason:
                    self._check_finish(reason, None, 2**63)
            return "200 stream"
        self._check_finish(json.loads(raw)["choices"][0]["finish_reason"], None, 2**63)
        return "200"

    def stalled_body(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A body that stops coming (a Content-Length never reached, or chunked framing that breaks
        once the body began, which aiohttp never reports: docs/gateway.md), then the client leaves:
        no answer meanwhile (or a 4xx in OpenAI's shape), and nothing of it left behind once gone."""
        how = rng.choice(["short body", "broken chunk"])
        with socket.create_connection(("127.0.0.1", self.g.port), timeout=60) as s:
            if how == "short body":
                s.sendall(http_bytes("POST", "/v1/completions", None, {"Content-Length": "100"}) + b'{"prompt": ')
            else:
                s.sendall(http_bytes("POST", "/v1/completions", None, {"Transfer-Encoding": "chunked"}) + b"2\r\n{}")
                time.sleep(0.2)  # the handler is reading the body now
                s.sendall(b"\r\nzz\r\n0\r\n\r\n")
            s.settimeout(rng.uniform(0.3, 0.8))
            try:
                got = s.recv(65536)
            except socket.timeout:
                return f"{how}: left unanswered"
            got = read_whole(s, got)
        status, h, raw = parse_http(got)
        if not 400 <= status < 500:
            raise Unexpected(f"{how}: {status} {raw[:200]!r}")
        return f"{how}: {status} {error_object(status, h, raw)['code']}"

    # --- clients that leave ----------------------------------------------------------------------
    def _long_body(self, rng: random.Random, stream: bool, chat: bool) -> dict:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.long_tokens, "stream": stream,
                                "logit_bias": self.ban_eos}
        if chat:
            body["messages"] = self._messages(rng)
        else:
            body["prompt"] = self._prompt(rng)
        if rng.random() < 0.3:
            body.update(temperature=0.8, seed=rng.randrange(1000))
        return body

    def stream_disconnect(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A raw client that closes its socket once the first SSE event arrived."""
        chat = rng.random() < 0.5
        data = http_bytes("POST", "/v1/chat/completions" if chat else "/v1/completions",
                          json.dumps(self._long_body(rng, True, chat)).encode(), {"Connection": None})
        with socket.create_connection(("127.0.0.1", self.g.port), timeout=60) as s:
            s.sendall(data)
            headers, _ = sse_head(s, time.monotonic() + 60)
            if rng.random() < 0.5:  # close with a reset (SO_LINGER 0) instead of a FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.left("stream_disconnect", headers.get("x-dflash-job-id"))
        return "closed after the first event"

    def early_disconnect(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A raw client that sends its request and closes before reading anything."""
        stream, chat = rng.random() < 0.5, rng.random() < 0.5
        data = http_bytes("POST", "/v1/chat/completions" if chat else "/v1/completions",
                          json.dumps(self._long_body(rng, stream, chat)).encode(), {"Connection": None})
        with socket.create_connection(("127.0.0.1", self.g.port), timeout=60) as s:
            s.sendall(data)
            if rng.random() < 0.5:
                time.sleep(rng.uniform(0.0, 0.05))
        return "closed before reading"

    def wait_disconnect(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A raw client waiting for a whole (non-streamed) answer that gives up mid-generation."""
        chat = rng.random() < 0.5
        data = http_bytes("POST", "/v1/chat/completions" if chat else "/v1/completions",
                          json.dumps(self._long_body(rng, False, chat)).encode(), {"Connection": None})
        with socket.create_connection(("127.0.0.1", self.g.port), timeout=60) as s:
            s.sendall(data)
            s.settimeout(rng.uniform(0.1, 0.6))
            try:
                got = s.recv(65536)
            except socket.timeout:
                return "gave up waiting"
            if got.startswith(b"HTTP/1.1 429"):
                check_busy(*parse_http(read_whole(s, got)))
        raise Unexpected(f"a {self.long_tokens}-token answer came in under a second: {got[:200]!r}")

    def stream_close(self, rng: random.Random, c: openai.OpenAI) -> str:
        """The openai library's own Stream.close() after a chunk or two."""
        chat = rng.random() < 0.5
        extra = {"logit_bias": self.ban_eos}
        if chat:
            raw = c.chat.completions.with_raw_response.create(model=self.model, messages=self._messages(rng),
                                                              max_tokens=self.long_tokens, stream=True,
                                                              extra_body=extra)
        else:
            raw = c.completions.with_raw_response.create(model=self.model, prompt=self._prompt(rng),
                                                         max_tokens=self.long_tokens, stream=True, extra_body=extra)
        stream = raw.parse()
        try:
            for i, _ in enumerate(stream):
                if i >= rng.randint(0, 2):
                    break
        finally:
            stream.close()
        self.left("stream_close", raw.headers.get("x-dflash-job-id"))
        return "closed by the library"

    def client_timeout(self, rng: random.Random, c: openai.OpenAI) -> str:
        """A non-streamed call the openai library cuts short with its own timeout."""
        short = c.with_options(timeout=rng.uniform(0.2, 0.8))
        try:
            if rng.random() < 0.5:
                short.chat.completions.create(model=self.model, messages=self._messages(rng),
                                              max_tokens=self.long_tokens, extra_body={"logit_bias": self.ban_eos})
            else:
                short.completions.create(model=self.model, prompt=self._prompt(rng), max_tokens=self.long_tokens,
                                         extra_body={"logit_bias": self.ban_eos})
        except openai.APITimeoutError:
            return "timed out"
        raise Unexpected(f"a {self.long_tokens}-token answer came in under a second")


# ---------------------------------------------------------------------------- sampling
def tcp_states(port: int) -> dict[str, int]:
    """The gateway port's TCP connections by state (/proc/net/tcp), listening socket excluded."""
    names = {"01": "established", "06": "time_wait", "08": "close_wait", "04": "fin_wait1", "05": "fin_wait2",
             "09": "last_ack", "0B": "closing"}
    out: Counter[str] = Counter()
    try:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            parts = line.split()
            local, state = parts[1], parts[3]
            if int(local.split(":")[1], 16) == port and state != "0A":
                out[names.get(state, state)] += 1
    except (OSError, IndexError, ValueError):
        pass
    return dict(sorted(out.items()))


class Sampler:
    """Idle-time samples, the orphan and accounting audits, the gateway's log findings."""

    def __init__(self, d: Daemon, g: Gateway, load: Load, idle_timeout: float):
        self.d, self.g, self.load = d, g, load
        self.idle_timeout = idle_timeout
        self.checked = 0  # left_jobs already looked up
        self.done0: int | None = None  # jobs_done when the load started
        self.seen0 = 0
        self.orphans: list[dict] = []
        self.log_findings: list[str] = []
        self.log_counts: Counter[str] = Counter()
        self.left_outcomes: Counter[str] = Counter()
        self.fives = 0  # 5xx answers the gateway counted so far
        self.left_tokens: dict[str, list[int]] = {}  # tokens each job whose client left had made when cancelled

    def _gateway_metrics(self) -> dict[str, Any]:
        status, _, body = parse_http(exchange(self.g.port, http_bytes("GET", "/metrics?format=json", None)))
        if status != 200:
            return {"error": status}
        gw = json.loads(body)["gateway"]
        by_status: Counter[str] = Counter()
        for row in gw["requests"]:
            by_status[str(row["status"])] += row["count"]
        return {"answers": sum(by_status.values()), "by_status": dict(sorted(by_status.items())), "jobs": gw["jobs"],
                "finish_reasons": gw["finish_reasons"]}

    def _audit_left_jobs(self, c: DFlashClient) -> dict[str, int]:
        """Every job whose client left, known by id, must have ended cancelled, cut short."""
        with self.load.lock:
            todo = self.load.left_jobs[self.checked:]
            self.checked = len(self.load.left_jobs)
        for kind, job_id in todo:
            st = c.status(job_id)
            res = st.result or {}
            n = len(res.get("token_ids") or [])
            key = f"{kind}:{st.state}"
            self.left_outcomes[key] += 1
            self.left_tokens.setdefault(kind, []).append(n)
            if st.state != "cancelled" or res.get("finish_reason") != "cancelled" or n >= self.load.long_tokens:
                self.load.unexpected(f"{kind}: job {job_id} whose client left is {st.state} "
                                     f"({res.get('finish_reason')}, {n} tokens)")
        return dict(self.left_outcomes)

    def _scan_log(self) -> dict[str, int]:
        for line in self.g.new_log_lines():
            if any(b in line for b in LOG_BENIGN):
                self.log_counts["benign"] += 1
                continue
            level = next((w for w in ("Traceback", "CRITICAL", "ERROR", "WARNING", "Exception", "Unclosed",
                                      "never retrieved") if w in line), None)
            if level is None:
                continue
            self.log_counts[level] += 1
            if len(self.log_findings) < 60:
                self.log_findings.append(line[:500])
        return dict(self.log_counts)

    def sample(self, c: DFlashClient, done: int, t0: float) -> dict[str, Any]:
        st, idle = soak.quiet_stats(self.d, c, self.idle_timeout, settle_s=0.5)
        jobs = c.jobs()
        if not idle or jobs or st.get("held"):
            row = {"requests": done, "idle": idle, "running": st.get("running"), "queued": st.get("queued"),
                   "held": st.get("held"), "jobs": jobs[:10]}
            self.orphans.append(row)
            self.load.unexpected(f"not idle after {done} requests: {row}")
        if self.done0 is None:
            self.done0, self.seen0 = st["jobs_done"], self.load.finished_seen
        unseen = (st["jobs_done"] - self.done0) - (self.load.finished_seen - self.seen0)
        if unseen and not any("jobs done that no client saw" in e for e in self.load.errors):
            self.load.unexpected(f"after {done} requests: {unseen} jobs done that no client saw finish "
                                 "(a client left and its job ran on to its end)")
        gm = self._gateway_metrics()
        fives = sum(n for code, n in gm.get("by_status", {}).items() if int(code) >= 500)
        if fives > self.fives:
            self.load.unexpected(f"after {done} requests: the gateway's /metrics counts {fives} 5xx answers")
            self.fives = fives
        procs = {name: proc_sample(pid, shmem=False, thread_names=False)
                 for name, pid in {"gateway": self.g.proc.pid, **self.d.pids()}.items()}
        return {
            **soak.sample_head(done, t0, procs),
            "gateway_tcp": tcp_states(self.g.port),
            "gateway_metrics": gm,
            "gateway_log": self._scan_log(),
            "tables": st.get("tables", {}),
            "daemon": {k: st.get(k) for k in ("queued", "running", "held", "jobs_done", "jobs_failed",
                                              "jobs_cancelled", "tokens_generated", "frames", "bad_frames",
                                              "dropped_replies", "clients_gone", "restarts")},
            "jobs_listed": len(jobs),
            "jobs_done_unseen": unseen,
            "left_jobs": self._audit_left_jobs(c),
            **soak.caches(st, l2_keys=("entries", "bytes")),
        }


def flat(s: dict[str, Any]) -> dict[str, float]:
    """The sample's gauges as {dotted.name: value}, the verdict's metrics."""
    out = soak.flat_procs(s, fd_kinds=True)
    # open connections (TIME_WAIT ones are closed: the kernel keeps them 60 s whatever the gateway does)
    out["gateway.tcp_open"] = sum(v for k, v in s["gateway_tcp"].items() if k != "time_wait")
    out.update(soak.flat_daemon(s))
    out["daemon.jobs_listed"] = s["jobs_listed"]
    out["daemon.held"] = s["daemon"].get("held") or 0
    return out


def verdict(series: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Growth per 100 requests of every gauge (of any sample) over the samples after the warm-up,
    by scripts/soak.py's rule: a metric grows when its least-squares slope is positive (for memory
    over its THRESHOLDS: 1 MiB per 100 requests), its last value is above the highest of the first
    half of the window, and it rose at least twice; a one-time step is not growth."""
    return soak.verdict(series, warmup, flatten=flat, by_design=BY_DESIGN, every_metric=True)


# ---------------------------------------------------------------------------- running it
def model_facts(model: str) -> tuple[int, list[int]]:
    """The target's vocabulary size and end-of-text token ids (config.json)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 256, []
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else [t for t in eos or [] if isinstance(t, int)]
    return int(cfg.get("vocab_size") or 256), eos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    soak.add_run_args(ap, requests=600, every=50, tiny_in="the tmp dir")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of the answers that run to the end")
    ap.add_argument("--long-tokens", type=int, default=4000,
                    help="max_tokens of the requests whose clients leave (their jobs must be cancelled)")
    ap.add_argument("--max-body-bytes", type=int, default=65536, help="the gateway's --max-body-bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blas", default="none", help="the daemon's blas setting")
    ap.add_argument("--retention-s", type=float, default=3600.0, help="the daemon's result_retention_s")
    ap.add_argument("--l1-entries", type=int, default=8, help="the daemon's l1_cache_entries")
    ap.add_argument("--max-queue", type=int, default=6,
                    help="the daemon's max_queue: small, so a burst (--burst requests at once) meets 429 busy")
    ap.add_argument("--burst", type=int, default=10, help="requests a burst sends at once")
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="seconds a sample waits for the daemon to go idle before calling it orphaned work")
    ap.add_argument("--kinds", default=None, help=f"comma-separated subset of the mix: {', '.join(MIX)}")
    args = soak.parse_run_args(ap, argv, "gateway_soak.py",
                               log_help="a directory to keep the daemon's and the gateway's logs in")
    kinds = soak.parse_kinds(args.kinds, MIX)
    root = Path(tempfile.mkdtemp(prefix="dfgws", dir="/tmp"))  # short: ipc paths are capped; 0700
    model, draft = args.model, args.draft
    if model is None:
        model, draft = soak.tiny_pair(root / "tiny")
    vocab, eos = model_facts(model)
    d = Daemon(model, draft, root, blas=args.blas, result_retention_s=args.retention_s, heartbeat_s=0.3,
               l1_cache_entries=args.l1_entries, max_queue=args.max_queue)
    g: Gateway | None = None
    series: list[dict[str, Any]] = []
    load: Load | None = None
    sampler: Sampler | None = None
    gateway_exit = None
    t0 = time.monotonic()
    try:
        d.start()
        g = Gateway(d, args.max_body_bytes, args.max_tokens)
        load = Load(g, args.seed, args.max_tokens, args.long_tokens, vocab, eos, kinds, args.burst)
        sampler = Sampler(d, g, load, args.idle_timeout)
        clients = [openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
                   for _ in range(args.threads)]
        with d.client(timeout=60) as c:
            series.append(sampler.sample(c, 0, t0))
            done = 0
            while done < args.requests:
                n = min(args.every, args.requests - done)
                soak.run_batch(load, n, args.threads, clients, name="gwsoak")
                done += n
                s = sampler.sample(c, done, t0)
                series.append(s)
                gp, wp = s["procs"]["gateway"], s["procs"].get("worker", {})
                print(f"[{s['elapsed_s']:7.1f}s] {done:5d} requests  gateway rss {gp.get('rss_kb', 0) / 1024:6.1f} MiB "
                      f"fds {gp.get('fds')} {gp.get('fd_kinds')} threads {gp.get('threads')} tcp {s['gateway_tcp']}  "
                      f"worker rss {wp.get('rss_kb', 0) / 1024:6.1f} MiB fds {wp.get('fds')} threads "
                      f"{wp.get('threads')}  daemon done {s['daemon']['jobs_done']} cancelled "
                      f"{s['daemon']['jobs_cancelled']} held {s['daemon']['held']} listed {s['jobs_listed']}  "
                      f"unexpected {load.n_errors}", flush=True)
        for cl in clients:
            cl.close()
    finally:  # each step whatever the one before did: no gateway or daemon outlives the soak
        try:
            if g is not None:
                try:
                    gateway_exit = g.stop()
                finally:
                    if sampler is not None:
                        sampler._scan_log()
        finally:
            try:
                d.stop()
            finally:
                if args.log:
                    Path(args.log).mkdir(parents=True, exist_ok=True)
                    for name in ("daemon.log", "gateway.log"):
                        if (root / name).exists():
                            shutil.copy(root / name, Path(args.log) / name)
                shutil.rmtree(root, ignore_errors=True)
    assert load is not None and sampler is not None
    if gateway_exit != 0:
        load.unexpected(f"the gateway's exit status on SIGTERM was {gateway_exit}")
    errors_in_log = sum(v for k, v in sampler.log_counts.items() if k not in ("benign", "WARNING"))
    warmup = soak.warmup_requests(args)
    import aiohttp

    report = {
        "machine": soak.machine(aiohttp=aiohttp.__version__, openai=openai.__version__),
        "command": " ".join(["python", "scripts/gateway_soak.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": soak.run_settings(args, MIX, load.kinds, long_tokens=args.long_tokens,
                                      max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                                      burst=args.burst),
        "outcomes": dict(sorted(load.outcomes.items())),
        "unexpected_errors": load.errors,
        "unexpected_count": load.n_errors,
        "disconnects": {"requests": {k: sum(n for o, n in load.outcomes.items() if o.split(":")[0] == k)
                                     for k in DISCONNECTS},
                        "jobs_checked": dict(sorted(sampler.left_outcomes.items())),
                        "tokens_when_cancelled": {k: {"jobs": len(v), "mean": round(sum(v) / len(v), 1), "max": max(v),
                                                      "of": args.long_tokens}
                                                  for k, v in sorted(sampler.left_tokens.items())},
                        "orphans": sampler.orphans,
                        "jobs_done_unseen": series[-1]["jobs_done_unseen"] if series else None},
        "gateway_log": {"counts": dict(sampler.log_counts), "lines": sampler.log_findings,
                        "errors": errors_in_log},
        "gateway_exit": gateway_exit,
        "series": series,
        "verdict": verdict(series, warmup),
    }
    soak.print_verdict(report["verdict"])
    print(f"unexpected: {load.n_errors}; orphans: {len(sampler.orphans)}; gateway log errors: {errors_in_log}; "
          f"left jobs: {dict(sampler.left_outcomes)}")
    for e in load.errors[:10]:
        print(f"  {e}")
    soak.write_report(report, args.out)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM still stops the processes started
    sys.exit(main())
