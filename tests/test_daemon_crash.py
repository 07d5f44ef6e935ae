"""kill -9 of the worker: streaming clients learn at once, persisted jobs survive the restart,
and a job that keeps killing the worker is failed after max_attempts."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from daemon_fixtures import PROMPTS, ROOT, make_daemon, reference, tiny_pair, wait_until  # noqa: F401

from dflash.client import JobFailedError, WorkerGoneError


def test_kill9_mid_stream_then_queued_jobs_complete(make_daemon, tiny_pair):  # noqa: F811
    d = make_daemon(max_attempts=3)
    c = d.client(timeout=60)
    pid = d.worker_pid()
    stream = c.stream(PROMPTS[0], max_tokens=200)
    it = iter(stream)
    next(it)
    queued = [c.submit(p, max_tokens=8) for p in PROMPTS[1:4]]
    assert all(c.status(h.job_id).state == "queued" for h in queued)

    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerGoneError) as e:
        for _ in it:
            pass
    noticed = time.monotonic() - t0
    assert noticed < 2.0, f"client noticed the dead worker after {noticed:.2f}s"
    assert e.value.job_id == stream.job_id

    for h, p in zip(queued, PROMPTS[1:4]):  # after the supervisor restarts the worker
        assert h.result(timeout=60).token_ids == reference(tiny_pair, p, 8)[1]
    again = c.job(stream.job_id).result(timeout=60)  # the interrupted job ran again, whole
    assert again.token_ids == reference(tiny_pair, PROMPTS[0], 200)[1]
    st = c.stats()
    assert st["pid"] != pid and st["restarts"] == 1 and st["recovered"] == 4
    c.close()


def test_job_that_keeps_crashing_is_failed(make_daemon):  # noqa: F811
    d = make_daemon(max_attempts=2)
    c = d.client(timeout=60)
    h = c.submit(PROMPTS[0], max_tokens=8000)
    for attempt in (1, 2):
        wait_until(lambda: (s := c.status(h.job_id)).state == "running" and s.attempts == attempt, what=f"attempt {attempt}")
        os.kill(c.stats()["pid"], signal.SIGKILL)
    with pytest.raises(JobFailedError) as e:
        h.result(timeout=60)
    assert e.value.code == "job_failed" and "2 times" in e.value.message
    ok = c.generate(PROMPTS[1], max_tokens=6)  # and the worker serves the next job
    assert len(ok.token_ids) == 6
    assert c.stats()["failed_on_recovery"] == 1
    c.close()


def test_a_shell_user_is_told_a_command_that_reaches_this_daemon(make_daemon, tiny_pair):  # noqa: F811
    """The recovery command in a shell's worker_gone error carries the options that reached this
    daemon (here a non-default endpoint and a timeout): run as printed, it prints the re-run."""
    d = make_daemon(max_attempts=3)
    pid = d.worker_pid()
    options = ["--endpoint", d.endpoint, "--timeout", "60"]
    cli = [sys.executable, "-m", "dflash.client.cli"]  # `dflash-client` without the installed script
    proc = subprocess.Popen([*cli, *options, "prompt", "--max-tokens", "200", PROMPTS[0]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.read(1)  # its first delta: the job is running
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    told = re.search(r"`(dflash-client [^`]*)` runs it again", err)
    assert proc.returncode == 3 and err.count("\n") == 1 and told, err
    *prefix, verb, job_id = shlex.split(told.group(1))
    assert prefix == ["dflash-client", *options] and verb == "result", told.group(1)
    out = subprocess.run([*cli, *prefix[1:], verb, job_id], capture_output=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (reference(tiny_pair, PROMPTS[0], 200)[0] + "\n").encode()  # bytes: the text has \r
