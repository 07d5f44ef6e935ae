"""Shared fixtures for the daemon tests: tiny models, real daemons in tmp dirs, references.

A `Daemon` is a real supervisor process (which spawns a real worker) on a private ipc socket in
a short tmp dir; it is killed as a process group on teardown, even when a test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from dflash.client import DFlashClient
from dflash.client.errors import DFlashError
from dflash.daemon.config import DaemonConfig

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"Question {i}: what is {i} plus {i * 3}? Tell me about the sea." for i in range(10)]


def wait_until(pred, timeout: float = 30.0, what: str = "condition", poll_s: float = 0.05) -> None:
    """Poll `pred` until it is true; fail the test naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def lock_holders(path: Path) -> list[int]:
    """The pids that hold a lock on `path` (Linux: /proc/locks names the file MAJ:MIN:INODE)."""
    try:
        st = os.stat(path)
        rows = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    name = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for row in rows:
        f = row.split()
        if "->" in f:  # a waiter's row ("1: -> FLOCK ..."), not a holder
            continue
        if len(f) > 5 and f[5] == name and f[4].isdigit() and int(f[4]) > 0:
            pids.append(int(f[4]))
    return pids


def why_held(paths: list[Path], log: Path) -> str:
    """For a failed wait on locks: who holds each, their thread states, and (after asking each
    worker or cache process among them for its Python stacks with SIGUSR1, answered in the log) the log's tail."""
    lines = []
    for path in paths:
        for pid in lock_holders(path):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().split(") ")[1][0]
                          for t in os.listdir(f"/proc/{pid}/task")]
                if "dflash.daemon.worker" in cmd or "dflash.cache.l2" in cmd:  # others have no SIGUSR1
                    # handler: it would end them
                    os.kill(pid, signal.SIGUSR1)
            except OSError as e:
                cmd, states = f"({e})", []
            lines.append(f"{path.name} held by {pid}: {cmd.strip()} threads {''.join(states)}")
    time.sleep(1.0)
    try:
        tail = log.read_text(errors="replace")[-6000:]
    except OSError as e:
        tail = f"(no log: {e})"
    return "\n".join(lines) + "\n--- log tail ---\n" + tail


def wait_locks_gone(paths: list[Path], log: Path, slow_s: float = 10.0) -> float:
    """After a supervisor's kill -9: wait until no process holds `paths`, within the lifeline's
    promise (its children stop as on SIGTERM, and exit hard GRACE_S later if that hangs), and
    return how long it took. A graceful stop takes well under a second; one slower than `slow_s`
    still keeps the promise, so it is reported as a warning with who holds what, their stacks
    and the log (why_held), not failed; past the promise the test fails with the same."""
    from dflash.daemon.lifeline import GRACE_S
    from dflash.daemon.supervisor import lock_held

    t0 = time.monotonic()
    warned = False
    while any(lock_held(p) for p in paths):
        waited = time.monotonic() - t0
        if waited > GRACE_S + 15:
            raise AssertionError(f"the dead daemon's locks outlived its lifeline's {GRACE_S:.0f} s:\n"
                                 f"{why_held(paths, log)}")
        if waited > slow_s and not warned:
            warnings.warn(f"a graceful stop still running {slow_s:.0f} s after the supervisor died:\n"
                          f"{why_held(paths, log)}", stacklevel=2)
            warned = True
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    from dflash.engine.tiny import build_draft, build_target

    d = tmp_path_factory.mktemp("tiny")
    build_target(d, "qwen3")
    build_draft(d / "draft", d)
    return str(d), str(d / "draft")


class Daemon:
    def __init__(self, model: str, draft: str, **settings):
        self.dir = Path(tempfile.mkdtemp(prefix="dfd", dir="/tmp"))  # short: ipc paths are capped
        defaults = dict(blas="none", restart_backoff_s=0.2, heartbeat_s=0.3)
        self.cfg = DaemonConfig(model=model, draft=draft, runtime_dir=str(self.dir / "run"),
                                state_dir=str(self.dir / "state"), **{**defaults, **settings})
        self.endpoint = self.cfg.resolved_endpoint()
        self.proc: subprocess.Popen | None = None
        self.log = open(self.dir / "daemon.log", "wb")

    def start(self, wait_s: float = 60.0) -> "Daemon":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash.daemon.supervisor", "--config-json", self.cfg.to_json()],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
        )
        self.wait_ready(wait_s)
        return self

    def client(self, **kw) -> DFlashClient:
        return DFlashClient(self.endpoint, config=self.cfg, **kw)

    def wait_ready(self, wait_s: float = 60.0) -> dict:
        end = time.monotonic() + wait_s
        with self.client(timeout=0.5, retry_interval=0.5) as c:
            while time.monotonic() < end:
                assert self.proc.poll() is None, f"daemon exited early:\n{self.logs()}"
                try:
                    st = c.stats()
                    if st["state"] == "ready":
                        return st
                except DFlashError:
                    pass
                time.sleep(0.1)
        raise AssertionError(f"daemon not ready in {wait_s}s:\n{self.logs()}")

    def worker_pid(self) -> int:
        with self.client(timeout=5) as c:
            return c.stats()["pid"]

    def logs(self) -> str:
        self.log.flush()
        return (self.dir / "daemon.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything left of the group
            except ProcessLookupError:
                pass
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def running(tiny_pair: tuple[str, str], **settings):
    """A started daemon for a module fixture (`yield from running(tiny_pair, ...)`), then stopped."""
    d = Daemon(*tiny_pair, **settings)
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture
def two_dirs():
    """Two fresh folders for two daemons' runtime and state dirs (short paths under /tmp: an
    ipc:// socket path must fit 107 bytes)."""
    made = [Path(tempfile.mkdtemp(prefix="dft", dir="/tmp")) for _ in range(2)]
    yield made
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_daemon(tiny_pair):
    """Factory: make_daemon(**settings) -> started Daemon; all torn down after the test."""
    started: list[Daemon] = []

    def make(start: bool = True, **settings) -> Daemon:
        d = Daemon(*tiny_pair, **settings)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        d.stop()


_REF_PAIR = {}


def reference(tiny_pair: tuple[str, str], prompt, max_tokens: int, **kw) -> tuple[str, list[int]]:
    """The same prompt run alone in this process (text and ids), for equality checks."""
    from dflash.engine.generate import Finished, stream_dflash_generate
    from dflash.engine.loading import load_pair
    from dflash.engine.prompting import build_prompt

    if tiny_pair not in _REF_PAIR:
        _REF_PAIR[tiny_pair] = load_pair(*tiny_pair)
    pair = _REF_PAIR[tiny_pair]
    ids = prompt if prompt and isinstance(prompt[0], int) else build_prompt(pair.tokenizer, prompt, system=kw.get("system"))
    # sampling (and the window, which a seed needs fixed to repeat its ids) as the worker passes them
    extra = {k: kw[k] for k in ("temperature", "top_p", "top_k", "seed", "min_p", "min_tokens_to_keep",
                                "verify_window", "logit_bias",
                                "repetition_penalty", "repetition_context_size", "presence_penalty",
                                "presence_context_size", "frequency_penalty", "frequency_context_size") if k in kw}
    for ev in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, max_tokens, stop=kw.get("stop", ()),
                                     **extra):
        if isinstance(ev, Finished):
            return ev.text, ev.token_ids
    raise AssertionError("no Finished event")


def raw_request(endpoint: str, msg: dict, timeout_ms: int = 10_000) -> dict:
    """One request map as-is over a plain DEALER socket (an old or a foreign client, or a frame
    no DFlashClient would send); the worker's reply map."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb(msg, use_bin_type=True))
        assert sock.poll(timeout_ms), "no reply"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
        ctx.term()


def interrupt_waiting_client(args: list[str], env: dict, stdout: Any = subprocess.PIPE,
                             stderr: Any = subprocess.PIPE, settle: float = 0.0) -> tuple[int, bytes, bytes]:
    """`dflash-client ARGS` against a TCP listener that never answers, Ctrl-C'd once it waits:
    (exit code, stdout, stderr; empty where they went to files). Its accept() shows the request
    is under way; `settle` seconds more put the command inside its wait for the answer."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(60)
        port = listener.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash.client.cli", "--endpoint", f"tcp://127.0.0.1:{port}", "--timeout", "60",
             *args], stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=ROOT, env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background run ignores it
        try:
            conn, _ = listener.accept()  # ZeroMQ connected: the request is under way
            conn.close()
            time.sleep(settle)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, out or b"", err or b""
