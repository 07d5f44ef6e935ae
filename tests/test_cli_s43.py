"""The command lines and the clients under a demanding user's input (session 43): a closed stdin,
undecodable bytes, an unreadable config, `| head`, Ctrl-C where no command handles it, places a
daemon cannot use. Each ends in one line on stderr and a documented exit code, never a
traceback. Real processes, a real daemon on a tiny model, real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from daemon_fixtures import PROMPTS, ROOT, interrupt_waiting_client, running, tiny_pair, wait_until  # noqa: F401

from dflash.client import AsyncDFlashClient, DFlashClient
from dflash.client.errors import BadRequestError

NOBODY = "ipc:///tmp/dflash-s43-nobody-listens.sock"


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


def _env(**extra: str) -> dict[str, str]:
    """This environment without a user's dflash settings (a config file, an endpoint), so a
    test sees only what it passes; Python's own SIGPIPE handling as usual."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s43-no-config", "DFLASH_BLAS": "none", **extra}


def _run(module: str, *args: str, stdin=subprocess.DEVNULL, input: bytes | None = None, preexec=None, env=None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m module args` to its end (stdin: none unless `input`; None: inherited)."""
    return subprocess.run([sys.executable, "-m", module, *args], stdin=None if input is not None else stdin,
                          input=input, capture_output=True, timeout=timeout, cwd=ROOT, env=env or _env(),
                          preexec_fn=preexec)


def _client_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return _run("dflash.client.cli", *args, **kw)


def _one_line(out: subprocess.CompletedProcess, code: int, prog: str = "dflash-client") -> str:
    """The single stderr line of a command that failed with `code` (no traceback)."""
    err = out.stderr.decode(errors="replace")
    assert out.returncode == code, (out.returncode, out.stdout[-300:], err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith(prog), err
    return err


def _close_stdin() -> None:
    os.close(0)  # the child starts with fd 0 closed (`<&-`): Python's sys.stdin is None


# ---------------------------------------------------------------- dflash-client, no daemon needed

def test_a_closed_stdin_is_one_line_not_a_traceback():
    """Before: AttributeError ('NoneType' object has no attribute 'buffer'), exit 1."""
    err = _one_line(_client_cli("--endpoint", NOBODY, "prompt", stdin=None, preexec=_close_stdin), 2)
    assert "stdin is closed" in err, err


@pytest.mark.parametrize("config, words", [("missing.toml", "cannot read the config file"),
                                           (".", "cannot read the config file"),
                                           ("broken.toml", "is not valid TOML"),
                                           ("unknown.toml", "unknown setting(s) bogus")])
def test_an_unusable_config_is_one_line_exit_2(tmp_path: Path, config: str, words: str):
    """Before: FileNotFoundError / IsADirectoryError / TOMLDecodeError / ValueError tracebacks,
    exit 1, from the client made before any command ran (the file named by --config or by
    DFLASH_CONFIG alike)."""
    (tmp_path / "broken.toml").write_text("x = [\n")
    (tmp_path / "unknown.toml").write_text("bogus = 1\n")
    path = str(tmp_path / config)
    err = _one_line(_client_cli("--config", path, "--timeout", "1", "status"), 2)
    assert words in err and path in err, err
    err = _one_line(_client_cli("--timeout", "1", "status", env=_env(DFLASH_CONFIG=path)), 2)
    assert words in err and path in err, err


def test_a_bad_setting_in_the_environment_is_one_line():
    err = _one_line(_client_cli("--timeout", "1", "status", env=_env(DFLASH_MAX_QUEUE="many")), 2)
    assert "environment: max_queue must be int" in err, err


@pytest.mark.parametrize("args, field", [(["result", "\udcff"], "job_id"), (["cancel", "j\udcfe"], "job_id"),
                                         (["positions", "put", "\udcff", "1"], "name"),
                                         (["positions", "get", "\udcff"], "name"),
                                         (["positions", "delete", "\udcff"], "name")])
def test_arguments_that_are_not_utf8_are_refused(args: list[str], field: str):
    """Undecodable bytes in a job id or a list name reached msgpack as lone surrogates: a
    UnicodeEncodeError traceback, exit 1. Now the field is named, exit 2, nothing sent."""
    err = _one_line(_client_cli("--endpoint", NOBODY, "--timeout", "1", *args), 2)
    assert f"field {field!r} is not valid Unicode" in err and "no dflash worker" not in err, err


def test_an_endpoint_that_is_not_utf8_is_refused():
    err = _one_line(_client_cli("--endpoint", "ipc:///tmp/\udcff.sock", "--timeout", "1", "status"), 2)
    assert "[bad_endpoint]" in err and "not valid Unicode" in err, err


def _close_stdout() -> None:
    os.close(1)  # `>&-`: Python's sys.stdout is None


@pytest.mark.parametrize("args", [["prompt", "hi"], ["status"]])
def test_a_closed_stdout_is_refused_before_anything_is_sent(daemon, args: list[str]):
    """With stdout closed, `prompt` died in a traceback (exit 1) once the first text came, its
    job already running; `status` printed nowhere and exited 0."""
    with daemon.client(timeout=10) as c:
        wait_until(lambda: not c.jobs(), 30, "an idle worker")
        before = {k: c.stats()[k] for k in ("jobs_done", "jobs_cancelled", "jobs_failed")}
        err = _one_line(_client_cli("--endpoint", daemon.endpoint, *args, preexec=_close_stdout), 2)
        assert "stdout is closed" in err and "nothing was sent" in err, err
        assert {k: c.stats()[k] for k in before} == before and not c.jobs()


def test_an_empty_stop_sequence_is_refused():
    """`--stop "$UNSET"` ran the job as if no stop were given; `dflash generate` refuses it."""
    err = _one_line(_client_cli("--endpoint", NOBODY, "--timeout", "1", "prompt", "--stop", "", "hi"), 2)
    assert "--stop" in err and "cannot be empty" in err, err


@pytest.mark.parametrize("args", [["status"], ["cache", "clear"], ["jobs"]])
def test_ctrl_c_where_no_command_handles_it_exits_130(args: list[str]):
    """Ctrl-C while `status` (or any command but prompt/result) waits for a worker printed
    click's "Aborted!" and exited 1, the code of a failed job; docs/daemon.md says 130. The
    endpoint is a plain TCP listener that never answers: its accept() shows the command waits."""
    code, out, err = interrupt_waiting_client(args, _env())
    assert code == 130, (code, out, err)
    assert b"Aborted" not in err and b"Traceback" not in err and b"interrupted" in err, err


def test_the_python_clients_refuse_fields_the_wire_cannot_carry():
    """DFlashClient.cancel / status / the position calls raised msgpack's UnicodeEncodeError or
    OverflowError; a submit already said BadRequestError naming the field. Now every request
    does, before anything is sent (nobody listens at NOBODY)."""
    with DFlashClient(NOBODY, timeout=1) as c:
        for call, field in ((lambda: c.cancel("\udcff"), "job_id"), (lambda: c.status("j\udcff"), "job_id"),
                            (lambda: c.job("\udcff").result(timeout=1), "job_id"),
                            (lambda: c.get_positions("\udcff"), "name"),
                            (lambda: c.put_positions("doc", [1, 1 << 70]), "positions")):
            with pytest.raises(BadRequestError) as e:
                call()
            assert e.value.param == field, e.value
        with pytest.raises(BadRequestError, match="bad_endpoint"), DFlashClient("ipc:///tmp/\udcff", timeout=1) as bad:
            bad.stats()

    async def refused() -> list[str]:
        params = []
        async with AsyncDFlashClient(NOBODY, timeout=1) as a:
            for call in (a.cancel("\udcff"), a.delete_positions("\udcff"), a.put_positions("d", [1 << 70])):
                try:
                    await call
                except BadRequestError as e:
                    params.append(e.param)
        return params

    assert asyncio.run(refused()) == ["job_id", "name", "positions"]


# ---------------------------------------------------------------- dflash-client against a daemon

def test_prompt_into_a_closed_pipe_cancels_the_job_and_exits_141(daemon):
    """`dflash-client prompt ... | head -c 1`: click took the broken pipe as a silent exit 1 (a
    failed job, said nowhere), the job cancelled only whenever the stream was collected. Now one
    line names the cancelled job, exit 141 (128 + SIGPIPE), and the worker has cancelled it."""
    with daemon.client(timeout=10) as c:
        wait_until(lambda: not c.jobs(), 30, "an idle worker")
        before = c.stats()["jobs_cancelled"]
        proc = subprocess.Popen([sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint, "prompt",
                                 PROMPTS[0], "-m", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=ROOT, env=_env())
        try:
            assert proc.stdout.read(1)  # streaming has begun (4000 tokens: ~10 s)
            proc.stdout.close()  # the reader goes away, as `head` does
            err = proc.stderr.read().decode()
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert code == 141, (code, err)
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert "stdout was closed" in err and "was cancelled" in err, err
        wait_until(lambda: not c.jobs(), 10, "the job to be cancelled")
        assert c.stats()["jobs_cancelled"] == before + 1


# ---------------------------------------------------------------- dflash generate / make-tiny

def test_generate_refuses_a_prompt_that_is_not_utf8(tiny_pair):  # noqa: F811
    """Undecodable bytes in --prompt / --system / --stop or on stdin reached the tokenizer as
    lone surrogates (a TypeError traceback after the model loaded) or made a stop string that
    never matches; now exit 2 with one line naming the byte, before any model loads."""
    model, draft = tiny_pair
    base = ["generate", "--model", model, "--draft", draft, "-m", "4"]
    for args in (["-p", "\udcff"], ["-p", "hi", "--system", "a\udcfe"], ["-p", "hi", "--stop", "\udcff"]):
        out = _run("dflash.engine.cli", *base, *args)
        err = out.stderr.decode(errors="replace")
        assert out.returncode == 2 and "Traceback" not in err and "not UTF-8 text (byte 0x" in err, (args, err)
    err = _one_line(_run("dflash.engine.cli", *base, input=b"caf\xe9"), 2, prog="Error:")
    assert "stdin is not UTF-8 text (byte 0xe9 at offset 3)" in err, err
    ok = _run("dflash.engine.cli", *base, "--json", input="café\r\n".encode())  # UTF-8 runs as before
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["token_ids"]) == 4, ok.stderr[-2000:]


def test_generate_with_stdin_closed_is_one_line():
    """Before: AttributeError ('NoneType' object has no attribute 'isatty'), exit 1."""
    out = _run("dflash.engine.cli", "generate", "--model", "/nonexistent", stdin=None, preexec=_close_stdin)
    err = _one_line(out, 2, prog="Error:")
    assert "stdin is closed" in err, err


def test_generate_into_a_closed_pipe_exits_141(tiny_pair):  # noqa: F811
    """`dflash generate ... | head -c 1`: a silent exit 1; now one line and 141."""
    model, draft = tiny_pair
    proc = subprocess.Popen([sys.executable, "-m", "dflash.engine.cli", "generate", "--model", model, "--draft", draft,
                             "-p", PROMPTS[0], "-m", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=ROOT, env=_env())
    try:
        assert proc.stdout.read(1)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 141 and "Traceback" not in err, (code, err)
    assert err.rstrip("\n").splitlines()[-1] == ("dflash: stdout was closed before all output was written; "
                                                 "generation stopped"), err


def test_generate_with_stdout_closed_is_one_line(tiny_pair):  # noqa: F811
    """Before: the text was dropped without a word and the exit status was 0 (or, with a fast
    BLAS to re-execute for, an AttributeError traceback); now refused before the model loads."""
    model, draft = tiny_pair
    err = _one_line(_run("dflash.engine.cli", "generate", "--model", model, "--draft", draft, "-p", "hi", "-m", "4",
                         preexec=_close_stdout), 2, prog="Error:")
    assert "stdout is closed" in err, err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where no folder can be made")
def test_make_tiny_into_a_folder_that_cannot_be_made_is_one_line():
    """Before: FileNotFoundError traceback from the staging folder beside OUT_DIR."""
    out = _run("dflash.engine.cli", "make-tiny", "/proc/dflash-s43-tiny")
    err = _one_line(out, 1, prog="Error:")
    assert "cannot write /proc/dflash-s43-tiny" in err and "nothing written" in err, err


# ---------------------------------------------------------------- dflashd

@pytest.fixture
def dirs():
    d = Path(tempfile.mkdtemp(prefix="dfs43", dir="/tmp"))
    yield d
    _run("dflash.daemon.cli", "stop", "--runtime-dir", str(d / "run"), "--state-dir", str(d / "state"), "--timeout", "20")
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _dflashd(*args: str) -> subprocess.CompletedProcess:
    return _run("dflash.daemon.cli", *args, timeout=180)


def test_start_refuses_a_socket_path_too_long(tiny_pair, dirs):  # noqa: F811
    """A runtime dir whose worker.sock is over the 107 bytes of a Unix socket address: the worker
    crashed at its bind, twice, and `start` said only "the worker keeps crashing" (exit 1)."""
    model, draft = tiny_pair
    deep = dirs / ("d" * 110)
    out = _dflashd("start", "--model", model, "--draft", draft, "--runtime-dir", str(deep),
                   "--state-dir", str(dirs / "state"), "--wait", "60")
    err = _one_line(out, 2, prog="Error:")
    assert "more than the 107 a Unix socket's address holds" in err and "worker.sock" in err, err


def test_start_refuses_an_endpoint_where_no_socket_can_be_made(tiny_pair, dirs):  # noqa: F811
    model, draft = tiny_pair
    (dirs / "file").write_text("")
    out = _dflashd("start", "--model", model, "--draft", draft, "--endpoint", f"ipc://{dirs}/file/w.sock",
                   "--runtime-dir", str(dirs / "run"), "--state-dir", str(dirs / "state"), "--wait", "60")
    err = _one_line(out, 2, prog="Error:")
    assert f"cannot make a file in {dirs}/file" in err, err


@pytest.mark.parametrize("which", ["runtime", "state"])
def test_start_and_stop_refuse_a_folder_under_a_file(tiny_pair, dirs, which: str):  # noqa: F811
    """A runtime or state dir under a file: NotADirectoryError / FileNotFoundError tracebacks
    from `start` and `stop`; now one line naming the folder, exit 2 (a configuration error)."""
    model, draft = tiny_pair
    (dirs / "file").write_text("")
    places = {"runtime": ["--runtime-dir", str(dirs / "file" / "run"), "--state-dir", str(dirs / "state")],
              "state": ["--runtime-dir", str(dirs / "run"), "--state-dir", str(dirs / "file" / "state")]}[which]
    err = _one_line(_dflashd("start", "--model", model, "--draft", draft, *places, "--wait", "60"), 2, prog="Error:")
    assert f"cannot use {dirs}/file/" in err and "Not a directory" in err, err
    if which == "runtime":
        err = _one_line(_dflashd("stop", *places), 2, prog="Error:")
        assert "Not a directory" in err, err


def test_waits_must_be_finite(tiny_pair, dirs):  # noqa: F811
    """--wait nan started a daemon and gave up at once ("did not become ready in nans"), leaving
    it running; stop --timeout nan did not wait at all."""
    model, draft = tiny_pair
    places = ["--runtime-dir", str(dirs / "run"), "--state-dir", str(dirs / "state")]
    for args in (["start", "--model", model, "--draft", draft, "--wait", "nan"], ["stop", "--timeout", "nan"],
                 ["start", "--model", model, "--draft", draft, "--wait", "-1"]):
        out = _dflashd(*args, *places)
        assert out.returncode == 2 and b"Traceback" not in out.stderr, (args, out.stderr)
        assert b"--wait" in out.stderr or b"--timeout" in out.stderr, out.stderr
    assert not (dirs / "run" / "supervisor.pid").exists()


def test_logs_n_0_prints_no_line_and_follow_ends_on_ctrl_c_with_130(dirs):
    """`logs -n 0` printed the whole log ([-0:] is every line); `logs -f` ended on Ctrl-C with
    click's "Aborted!" and exit 1."""
    places = ["--runtime-dir", str(dirs / "run"), "--state-dir", str(dirs / "state")]
    (dirs / "state" / "logs").mkdir(parents=True)
    (dirs / "state" / "logs" / "dflashd.log").write_text("one\ntwo\nthree\n")
    assert _dflashd("logs", "-n", "0", *places).stdout == b""
    assert _dflashd("logs", "-n", "2", *places).stdout == b"two\nthree\n"
    assert _dflashd("logs", "-n", "-1", *places).returncode == 2
    proc = subprocess.Popen([sys.executable, "-m", "dflash.daemon.cli", "logs", "-f", "-n", "1", *places],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == b"three\n"  # following now
        time.sleep(0.5)  # into its wait for new lines
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and b"Aborted" not in err and b"Traceback" not in err, (proc.returncode, err)
