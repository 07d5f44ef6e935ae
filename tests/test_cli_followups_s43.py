"""Follow-ups of session 43's command-line audit: `dflash generate` refuses a prompt past the
model's context as the daemon does; Ctrl-C while `dflashd start` waits stops what it started;
huge option values are named clipped (protocol.shown) in every command's errors; a daemon of
another protocol version is exit 2 (a BadRequestError), not 1; the BLAS re-exec of `dflash
benchmark` / `train-draft` survives a closed stdout. Real processes, real sockets, a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from daemon_fixtures import ROOT, running, tiny_pair, wait_until  # noqa: F401

from dflash.client import errors as E
from dflash.client.cli import exit_code
from dflash.client.errors import BadRequestError
from dflash.daemon import protocol as P
from dflash.engine import accel
from dflash.engine.generate import context_problem

HUGE = 10**300  # 301 digits
UNREADABLE = "9" * 5000  # past 4300 digits: int() refuses to read it


def _env(**extra: str) -> dict[str, str]:
    """This environment without a user's dflash settings; no BLAS re-exec unless a test asks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s43g-no-config", "DFLASH_BLAS": "none",
            **extra}


def _run(module: str, *args: str, env=None, preexec=None, input: bytes | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], input=input,
                          stdin=None if input is not None else subprocess.DEVNULL, capture_output=True,
                          timeout=timeout, cwd=ROOT, env=env or _env(), preexec_fn=preexec)


def _last_line(out: subprocess.CompletedProcess) -> str:
    err = out.stderr.decode(errors="replace")
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1] if err.strip() else ""


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


# ---------------------------------------------------------------- 1. the model's context

def test_generate_refuses_a_prompt_past_the_context_as_the_daemon_does(tiny_pair, daemon):  # noqa: F811
    """Before: `dflash generate` prefilled a prompt the tiny target's 4,096 positions cannot hold
    and decoded on (exit 0) while the daemon refused it. Now both refuse it, in the same words
    (one rule, engine/generate.context_problem); the CLI's exit status is 2, a bad prompt's."""
    model, draft = tiny_pair
    text = " ".join(["hello"] * 1025)  # 4,099 tokens raw: past the 4,096 positions
    out = _run("dflash.engine.cli", "generate", "--model", model, "--draft", draft, "--raw", "-m", "2",
               input=text.encode())
    line = _last_line(out)
    assert out.returncode == 2 and out.stdout == b"", (out.returncode, out.stdout[-200:], line)
    with daemon.client() as c, pytest.raises(BadRequestError) as exc:
        c.generate(text, raw=True, max_tokens=2)
    assert line == f"Error: {exc.value.message}", (line, exc.value.message)
    assert "context of 4096 tokens" in line
    # the rule itself: the prompt must leave a position; max_tokens is not added (the daemon's)
    assert context_problem(4095, 4096) is None and context_problem(4096, 4096) is not None
    assert context_problem(10**6, 0) is None  # a model that declares no context: anything runs


# ---------------------------------------------------------------- 2. Ctrl-C in `dflashd start`

def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, where /proc tells, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _feed(fifo: Path, data: bytes) -> None:
    """Write the draft's weights into the FIFO its loader is blocked on (a load that finishes
    when the test says so); a daemon thread, as nobody may ever open it for reading."""
    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(data)

    threading.Thread(target=write, daemon=True).start()


def test_ctrl_c_while_start_waits_stops_what_it_started(tiny_pair):  # noqa: F811
    """Before: click's "Aborted!", exit 1, and the supervisor, worker and cache process left
    running (the worker still loading). Now one line, exit 130, and nothing left running. The
    draft's weights are a FIFO, so the load waits until the test writes them."""
    model, draft = tiny_pair
    base = Path(tempfile.mkdtemp(prefix="dfg", dir="/tmp"))  # short: ipc paths are capped
    pids: list[int] = []
    try:
        slow = base / "model"
        shutil.copytree(model, slow, ignore=shutil.ignore_patterns("draft"))
        shutil.copytree(draft, slow / "draft")
        weights = (slow / "draft" / "model.safetensors").read_bytes()
        (slow / "draft" / "model.safetensors").unlink()
        os.mkfifo(slow / "draft" / "model.safetensors")
        run = base / "run"
        # SIGINT as in a terminal: CI runs tests in the background, where it starts ignored
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash.daemon.cli", "start", "--model", str(slow), "--draft", str(slow / "draft"),
             "--runtime-dir", str(run), "--state-dir", str(base / "state"), "--wait", "300"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=_env(),
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

        def started() -> bool:
            try:
                state = json.loads((run / "supervisor.json").read_text())
            except (OSError, ValueError):
                return False
            children = [c.get("pid") for c in state.get("children", {}).values()]
            if len(children) == 2 and all(children):
                pids[:] = [state["supervisor_pid"], *children]
                return True
            return False

        wait_until(started, 60, "the supervisor to start the worker and the cache process")
        assert proc.poll() is None and all(map(_alive, pids)), pids
        proc.send_signal(signal.SIGINT)
        _feed(slow / "draft" / "model.safetensors", weights)
        out, err = proc.communicate(timeout=90)
        text = err.decode(errors="replace")
        assert proc.returncode == 130, (proc.returncode, text)
        assert "Aborted" not in text and "Traceback" not in text, text
        lines = text.strip().splitlines()
        assert len(lines) == 1 and "interrupted" in lines[0] and "stopping" in lines[0], text
        assert not [p for p in pids if _alive(p)], f"left running: {[p for p in pids if _alive(p)]}"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- 3. huge option values, clipped

@pytest.mark.parametrize("module, args", [
    ("dflash.engine.cli", ["generate", "--model", "m", "-p", "hi", "--seed", str(HUGE)]),
    ("dflash.engine.cli", ["generate", "--model", "m", "-p", "hi", "--max-tokens", str(-HUGE)]),
    ("dflash.engine.cli", ["generate", "--model", "m", "-p", "hi", "--top-k", UNREADABLE]),
    ("dflash.engine.cli", ["generate", "--model", "m", "-p", "hi", "--repetition-penalty", "x" + UNREADABLE]),
    ("dflash.engine.cli", ["make-tiny", "/nonexistent/tiny", "--draft-layers", str(-HUGE)]),
    ("dflash.client.cli", ["prompt", "hi", "--seed", str(HUGE)]),
    ("dflash.client.cli", ["prompt", "hi", "--min-tokens-to-keep", str(-HUGE)]),
    ("dflash.client.cli", ["prompt", "hi", "--priority", UNREADABLE]),
    ("dflash.client.cli", ["prompt", "hi", "--positions", "x" + UNREADABLE]),
    ("dflash.client.cli", ["prompt", "hi", "--positions", f"{HUGE}-5"]),
    ("dflash.client.cli", ["prompt", "hi", "--verify-window", UNREADABLE]),
    ("dflash.client.cli", ["--timeout", "x" + UNREADABLE, "status"]),
    ("dflash.daemon.cli", ["logs", "-n", str(-HUGE)]),
    ("dflash.daemon.cli", ["start", "--max-queue", UNREADABLE]),
])
def test_a_huge_option_value_is_named_clipped(module: str, args: list[str]):
    """Before: every digit echoed (a 300-digit seed), or all 5,000 characters of a value too long
    for int() ('--verify-window 999…' was a ValueError traceback in dflash-client). Now the value
    is clipped as the daemon's errors clip it, exit 2."""
    env = _env(DFLASH_ENDPOINT="ipc:///tmp/dflash-s43g-nobody.sock")
    out = _run(module, *args, env=env)
    line = _last_line(out)
    assert out.returncode == 2, (out.returncode, line[:300])
    assert len(line) < 300 and ("…(301 digits)" in line or "characters)" in line), line[:400]


def test_an_ordinary_bad_value_reads_as_before():
    """Valid-sized values keep click's words: the type only clips what is long."""
    out = _run("dflash.client.cli", "prompt", "hi", "--top-p", "2",
               env=_env(DFLASH_ENDPOINT="ipc:///tmp/dflash-s43g-nobody.sock"))
    assert out.returncode == 2 and "2.0 is not in the range 0<x<=1" in _last_line(out)


def test_a_verify_window_int_cannot_read_stays_text():
    """protocol.window_from_text: '²' and 5,000 digits raised ValueError out of int()."""
    for text in ("²", UNREADABLE):
        assert P.window_from_text(text) == text
        problem = P.verify_window_problem(P.window_from_text(text))
        assert problem is not None and len(problem) < 200, problem
    assert P.window_from_text("8") == 8 and P.window_from_text("auto") == "auto"


# ---------------------------------------------------------------- 5. exit codes by class

DOCUMENTED = {E.BusyError: 4, E.BadRequestError: 2, E.ProtocolVersionError: 2, E.NotFoundError: 5,
              E.JobFailedError: 1, E.WorkerUnavailableError: 3, E.WorkerGoneError: 3, E.CacheUnavailableError: 1,
              E.ClientTimeoutError: 1, E.ClientClosedError: 1, E.DFlashError: 1}


def test_every_error_class_has_its_documented_exit_code():
    """docs/daemon.md's codes; a new error class fails here until it is given one."""
    classes, todo = set(), [E.DFlashError]
    while todo:
        cls = todo.pop()
        classes.add(cls)
        todo.extend(cls.__subclasses__())
    assert classes == set(DOCUMENTED), classes ^ set(DOCUMENTED)
    for cls, code in DOCUMENTED.items():
        assert exit_code(cls("x", "y")) == code, cls


def _foreign_daemon(endpoint: str, reply: dict, stop: threading.Event) -> threading.Thread:
    """A ZeroMQ ROUTER that answers every request with `reply` (its rid set to the request's)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)

    def serve() -> None:
        try:
            while not stop.is_set():
                if sock.poll(100):
                    ident, frame = sock.recv_multipart()
                    rid = msgpack.unpackb(frame, raw=False).get("rid", 0)
                    sock.send_multipart([ident, msgpack.packb({**reply, "rid": rid}, use_bin_type=True)])
        finally:
            sock.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("reply", [
    {"v": P.VERSION + 1, "type": "info", "data": {}},  # an older client than the daemon: its reply
    {"v": P.VERSION, "type": "error", "code": P.BAD_VERSION, "message": "dflash protocol version mismatch",
     "job_id": "", "param": ""},  # the daemon refused our request's version
])
def test_a_daemon_of_another_protocol_version_is_exit_2(reply: dict):
    """Before: ProtocolVersionError (a BadRequestError) missed the exact-class lookup: exit 1."""
    endpoint = f"ipc://{tempfile.gettempdir()}/dflash-s43g-v{os.getpid()}.sock"
    stop = threading.Event()
    thread = _foreign_daemon(endpoint, reply, stop)
    try:
        out = _run("dflash.client.cli", "--endpoint", endpoint, "--timeout", "5", "status")
    finally:
        stop.set()
        thread.join(5)
    line = _last_line(out)
    assert out.returncode == 2 and "[bad_version]" in line, (out.returncode, line)


# ---------------------------------------------------------------- 6. the BLAS re-exec, stdout closed

def _reexec_env() -> dict[str, str]:
    env = _env()
    for name in ("DFLASH_BLAS", accel.MARK, "LD_PRELOAD"):
        env.pop(name, None)
    return env


@pytest.mark.skipif(accel.plan("auto", env={}) is None, reason="no re-exec here (no MKL to preload)")
@pytest.mark.parametrize("command", ["benchmark", "train-draft"])
def test_the_blas_reexec_survives_a_closed_stdout(command: str):
    """Before: maybe_reexec flushed sys.stdout (None with `>&-`): AttributeError, exit 1, before
    the command ran. Now the re-executed command runs (its --help: exit 0, nothing on stderr)."""
    out = _run("dflash.engine.cli", command, "--help", env=_reexec_env(), preexec=lambda: os.close(1))
    assert out.returncode == 0 and out.stderr == b"", (out.returncode, out.stderr.decode(errors="replace")[-2000:])
