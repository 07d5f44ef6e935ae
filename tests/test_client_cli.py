"""`dflash-client` usage errors and the commands its messages print: real processes against a
real daemon on a tiny model (and the pure helpers those messages are made from)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from daemon_fixtures import ROOT, running, tiny_pair  # noqa: F401

from dflash.client.cli import MAX_POSITIONS, cli_command, parse_positions
from dflash.client.errors import JobFailedError, WorkerGoneError


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


def _cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint, *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def _one_line_usage_error(out: subprocess.CompletedProcess) -> str:
    """The error line of a refused command line (exit 2, nothing else printed)."""
    assert out.returncode == 2 and not out.stdout, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("dflash-client: "), out.stderr
    assert "Traceback" not in out.stderr and "Usage:" not in out.stderr
    return out.stderr


def test_a_timeout_that_is_not_positive_is_a_usage_error(daemon):
    for value in ("-1", "0", "nan", "inf", "soon"):
        err = _one_line_usage_error(_cli(daemon, "--timeout", value, "status"))
        assert "--timeout" in err and "no dflash worker" not in err, err
    ok = _cli(daemon, "--timeout", "0.5", "status", "--json")  # a worker is up: it answers
    assert ok.returncode == 0 and json.loads(ok.stdout)["state"] == "ready", ok.stderr


def test_a_reversed_range_is_named(daemon):
    err = _one_line_usage_error(_cli(daemon, "positions", "put", "doc", "0-3,5-1"))
    assert "bad range 5-1: the end is before the start" in err and "empty" not in err, err
    err = _one_line_usage_error(_cli(daemon, "prompt", "--positions", "5-1", "hi"))
    assert "--positions" in err and "bad range 5-1" in err, err
    err = _one_line_usage_error(_cli(daemon, "prompt", "--positions", f"0-{10 * MAX_POSITIONS}", "hi"))
    assert "cannot be sent" in err, err  # refused before a list that size is built
    ok = _cli(daemon, "positions", "put", "doc", "0-3, 7")
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"name": "doc", "stored": 5}, ok.stderr
    assert json.loads(_cli(daemon, "positions", "get", "doc").stdout) == [0, 1, 2, 3, 7]


def test_other_usage_errors_are_one_line(daemon):
    for args, word in ((["prompt", "--temperature", "-1", "hi"], "--temperature"), (["result"], "JOB_ID"),
                       (["no-such-command"], "no-such-command")):
        assert word in _one_line_usage_error(_cli(daemon, *args)), args


def test_parse_positions():
    assert parse_positions("0-2, 5,7-7") == [0, 1, 2, 5, 7]
    assert parse_positions("") == []
    for text, words in (("5-1", "bad range 5-1: the end is before the start"), ("-3", "'-3' is not a position"),
                        ("1-", "'1-' is not a position"), ("0-x", "'0-x'"), (f"0-{MAX_POSITIONS}", "cannot be sent")):
        with pytest.raises(ValueError, match=words):
            parse_positions(text)


def test_the_rerun_command_keeps_the_connection_options():
    assert cli_command() == "dflash-client"
    cmd = cli_command("ipc:///tmp/x y/w.sock", "conf.toml", 60.0)
    assert cmd == "dflash-client --endpoint 'ipc:///tmp/x y/w.sock' --config conf.toml --timeout 60"
    gone = WorkerGoneError("worker_gone", "the worker stopped answering", "j1")
    assert gone.describe(cmd).endswith(f"job j1 is kept: `{cmd} result j1` runs it again and prints it")
    assert str(gone).endswith("`dflash-client result j1` runs it again and prints it")  # in Python: the plain form
    assert str(JobFailedError("job_failed", "boom", "j2")) == "[job_failed] boom (job j2)"
