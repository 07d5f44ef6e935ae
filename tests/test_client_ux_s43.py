"""dflash-client follow-ups of session 43's audit: an error after part of a streamed answer starts
on a line of its own (stdout's bytes stay the answer when redirected); a prompt read from a
terminal says so; `--endpoint ""` is refused. Real processes, a real daemon on a tiny model, a
worker killed mid-stream, a pty for the terminal."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tty
from pathlib import Path

import pytest
from daemon_fixtures import PROMPTS, ROOT, reference, running, tiny_pair, wait_until  # noqa: F401

from dflash.client.errors import DFlashError

CLI = [sys.executable, "-m", "dflash.client.cli"]
MAX_TOKENS = 800  # the tiny model's greedy answer to PROMPTS[1] has no newline this long
NOBODY = "ipc:///tmp/dflash-s43ux-nobody.sock"
HINT = "dflash-client: reading the prompt from stdin (end it with Ctrl-D)"  # `dflash generate`'s words


def _env(**extra: str) -> dict[str, str]:
    """This environment without a user's dflash settings or config file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s43ux-no-config", **extra}


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, max_attempts=10)


@pytest.fixture(scope="module")
def answer(tiny_pair) -> str:  # noqa: F811
    """The whole greedy answer the killed streams are cut from; newline-free, so a streamed part
    can never end a line by itself."""
    text = reference(tiny_pair, PROMPTS[1], MAX_TOKENS)[0]
    assert text and "\n" not in text, "the tiny model's answer has a newline: pick another prompt"
    return text


class _Drain:
    """Reads a file descriptor to its end in a thread (a pty's master reads EIO at the end)."""

    def __init__(self, fd: int):
        self.fd, self.data = fd, bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                return
            if not chunk:
                return
            self.data += chunk

    def all(self) -> bytes:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the output never ended"
        return bytes(self.data)


def _kill_worker_mid_stream(daemon, stdout, stderr, started) -> subprocess.Popen:
    """Run `prompt` with these streams, SIGKILL the worker once `started(proc)` saw streamed text,
    wait for the client to exit and the restarted worker to be ready."""
    pid = daemon.worker_pid()
    proc = subprocess.Popen([*CLI, "--endpoint", daemon.endpoint, "--timeout", "60", "prompt", "--max-tokens",
                             str(MAX_TOKENS), PROMPTS[1]], stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr, cwd=ROOT, env=_env())
    try:
        wait_until(lambda: started(proc), 60, "the first streamed text")
        os.kill(pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(lambda: _ready_with_new_pid(daemon, pid), 60, "the restarted worker")
    return proc


def _ready_with_new_pid(daemon, old: int) -> bool:
    try:
        with daemon.client(timeout=2) as c:
            st = c.stats()
    except DFlashError:  # restarting: not answering yet
        return False
    return st["state"] == "ready" and st["pid"] not in (None, old)


def test_on_a_terminal_the_error_after_streamed_text_starts_a_line(daemon, answer):
    """Before: the worker_gone line followed the streamed text on the same terminal line. Now a
    newline goes to stdout (a terminal), and stderr's line is just the error."""
    master, slave = os.openpty()
    tty.setraw(slave)  # bytes as written: no \\n -> \\r\\n
    shown = _Drain(master)
    try:
        proc = _kill_worker_mid_stream(daemon, slave, subprocess.PIPE, lambda _: len(shown.data) > 0)
    finally:
        os.close(slave)
    out, err = shown.all(), proc.stderr.read().decode()
    os.close(master)
    assert proc.returncode == 3, (proc.returncode, err)
    assert err.count("\n") == 1 and err.startswith("dflash-client: ") and "runs it again" in err, err
    text = out.decode()
    assert text.endswith("\n"), f"the streamed text's line was left open: {text[-80:]!r}"
    assert text[:-1] and answer.startswith(text[:-1]), text[-80:]


def test_redirected_stdout_keeps_exactly_the_streamed_text(daemon, answer):
    """stdout a pipe, stderr another: nothing is added to stdout's bytes (no newline: they are
    the answer, cut short) and stderr is the one error line."""
    first = bytearray()

    def started(proc: subprocess.Popen) -> bool:
        if select.select([proc.stdout], [], [], 0)[0]:
            first.extend(os.read(proc.stdout.fileno(), 1))
        return bool(first)

    proc = _kill_worker_mid_stream(daemon, subprocess.PIPE, subprocess.PIPE, started)
    out, err = bytes(first) + proc.stdout.read(), proc.stderr.read().decode()
    assert proc.returncode == 3, (proc.returncode, err)
    assert out and answer.startswith(out.decode()), out[-80:]  # no newline added
    assert err.count("\n") == 1 and err.startswith("dflash-client: "), err


def test_with_stderr_on_stdout_the_error_starts_a_line(daemon, answer):
    """`2>&1` into one pipe (or file): before, text and error ran together on one line. Now the
    error's line starts with the newline (stdout itself wrote only the answer)."""
    read, write = os.pipe()
    both = _Drain(read)
    try:
        proc = _kill_worker_mid_stream(daemon, write, write, lambda _: len(both.data) > 0)
    finally:
        os.close(write)
    lines = both.all().decode().split("\n")
    os.close(read)
    assert proc.returncode == 3, (proc.returncode, lines)
    assert len(lines) == 3 and lines[2] == "", lines
    assert lines[0] and answer.startswith(lines[0]), lines[0][-80:]
    assert lines[1].startswith("dflash-client: ") and "runs it again" in lines[1], lines[1]


def test_a_prompt_read_from_a_terminal_is_announced(daemon):
    """Before: `dflash-client prompt` with no TEXT on a terminal waited without a word. Now one
    line on stderr, `dflash generate`'s words, then it reads to Ctrl-D; piped stdin: no line."""
    args = [*CLI, "--endpoint", daemon.endpoint, "--timeout", "60", "prompt", "--max-tokens", "8"]
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(args, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                env=_env())
    finally:
        os.close(slave)
    echoed = _Drain(master)  # the terminal's echo of what is typed
    try:
        said, end = b"", time.monotonic() + 30
        while b"\n" not in said and time.monotonic() < end:
            if select.select([proc.stderr], [], [], 0.2)[0]:
                chunk = os.read(proc.stderr.fileno(), 4096)
                if not chunk:
                    break
                said += chunk
        assert said.decode() == HINT + "\n", f"no hint while it waits for the terminal: {said!r}"
        assert proc.poll() is None  # still waiting for the prompt
        os.write(master, b"hello\x04\x04")  # type "hello", Ctrl-D twice: the end of input
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        echoed.all()
    assert proc.returncode == 0 and err == b"", (proc.returncode, err)
    piped = subprocess.run(args, input=b"hello", capture_output=True, timeout=60, cwd=ROOT, env=_env())
    assert piped.returncode == 0 and piped.stderr == b"", piped.stderr  # a pipe is not told
    assert out == piped.stdout and out.strip(), (out, piped.stdout)  # the typed prompt was the prompt


def test_an_empty_endpoint_is_refused():
    """Before: `--endpoint ""` (a `--endpoint "$UNSET"`) went to the default endpoint. Now one
    line, exit 2, before anything is sent or read."""
    for args in (["--endpoint", "", "--timeout", "2", "status"], ["--endpoint=", "--timeout", "2", "prompt"]):
        out = subprocess.run([*CLI, *args], input=b"hi", capture_output=True, timeout=60, cwd=ROOT,
                             env=_env(DFLASH_ENDPOINT=NOBODY))
        err = out.stderr.decode()
        assert out.returncode == 2 and out.stdout == b"", (args, out.returncode, err)
        assert err.count("\n") == 1 and "'--endpoint'" in err and "empty" in err, err


def test_an_empty_dflash_endpoint_still_means_the_derived_one(tmp_path: Path):
    """Only the flag is refused: an empty DFLASH_ENDPOINT keeps the config's meaning of "" (the
    endpoint derived from the runtime dir), the one `dflashd start` in that environment binds."""
    out = subprocess.run([*CLI, "--timeout", "0.5", "status"], capture_output=True, stdin=subprocess.DEVNULL,
                         timeout=60, cwd=ROOT, env=_env(DFLASH_ENDPOINT="", DFLASH_RUNTIME_DIR=str(tmp_path)))
    err = out.stderr.decode()
    assert out.returncode == 3 and f"ipc://{tmp_path}/worker.sock" in err and err.count("\n") == 1, err
