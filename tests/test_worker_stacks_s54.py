"""`kill -USR1 <worker pid>` writes every thread's Python stack to the daemon's log, and the
worker keeps serving: how a stop that hangs or a job that never ends is diagnosed on a live daemon
(a real supervisor, worker and ZeroMQ socket on the tiny model).

Proves: the log gains the stacks of the socket thread (Worker.serve) and of the MLX thread
(Compute.run) under faulthandler's "Thread 0x..." headers, and the same worker (same pid, nothing
restarted) answers a generation afterwards.
"""

from __future__ import annotations

import os
import signal

from daemon_fixtures import make_daemon, tiny_pair, wait_until  # noqa: F401


def test_sigusr1_logs_every_thread_stack_and_the_worker_serves_on(make_daemon):  # noqa: F811
    d = make_daemon()
    pid = d.worker_pid()
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: "in serve" in d.logs() and "in run" in d.logs(), timeout=10,
               what="the worker's stacks in the log")
    logs = d.logs()
    assert logs.count("Thread 0x") >= 2, logs[-3000:]  # the socket thread and the MLX thread at least
    assert "daemon/worker.py" in logs and "daemon/compute.py" in logs, logs[-3000:]
    with d.client() as c:
        out = c.generate("Hello there", max_tokens=4)
    assert len(out.token_ids) == 4
    assert d.worker_pid() == pid and d.logs().count("started worker pid") == 1
