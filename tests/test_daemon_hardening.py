"""Daemon hardening (issue #13), with real processes and real files: children do not outlive a
supervisor killed with kill -9 and its stale state misleads nobody; a damaged job store is moved
aside instead of crash-looping the worker; streamed jobs whose client gave up wait to be asked
for instead of blocking the queue; the job store holds no pickle."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
from daemon_fixtures import PROMPTS, make_daemon, reference, tiny_pair, wait_until  # noqa: F401

from dflash.client import DFlashClient, NotFoundError, WorkerGoneError
from dflash.daemon import lifeline, paths
from dflash.daemon.queue import Job
from dflash.daemon.store import JobStore



def _gone(pid: int) -> bool:
    """No such process, or only its zombie (whoever adopted it may not reap it at once)."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return not out or out.startswith("Z")


def _ps(*pids: int) -> str:
    """What ps says of these processes (state, threads' wait channel), for a failure message."""
    return subprocess.run(["ps", "-o", "pid,stat,wchan:24,etime,args", "-p", ",".join(map(str, pids))],
                          capture_output=True, text=True).stdout


def _log_tail(cli, chars: int = 4000) -> str:
    logs = sorted((cli.dir / "state").rglob("*.log"))
    return "".join(p.read_text(errors="replace")[-chars:] for p in logs)


@pytest.fixture
def cli(tiny_pair):  # noqa: F811
    """Run `dflashd ARGS` for a daemon in a private tmp dir (fast restarts), with the usual login
    umask (022); `run.flags` may be changed before the first call. Stop whatever is left."""
    d = Path(tempfile.mkdtemp(prefix="dfh", dir="/tmp"))
    model, draft = tiny_pair
    flags = ["--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")]
    env = dict(os.environ, DFLASH_RESTART_BACKOFF_S="0.2")

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        extra = ["--model", model, "--draft", draft] if args[0] == "start" else []
        return subprocess.run([sys.executable, "-m", "dflash.daemon.cli", *args, *extra, *flags],
                              capture_output=True, text=True, timeout=timeout, env=env, umask=0o022)

    run.dir, run.flags = d, flags
    run.status = lambda: json.loads(run("status", "--json").stdout)
    yield run
    run("stop", timeout=60)
    for pid in getattr(run, "pids", []):  # anything a failed test left behind
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def _state(cli) -> dict:
    return json.loads((cli.dir / "run" / "supervisor.json").read_text())


def _wait_restarted(cli, old_pid: int) -> int:
    def up() -> bool:
        w = cli.status()["worker"]
        return bool(w) and w["pid"] != old_pid and w["state"] == "ready"

    wait_until(up, 60, "the worker to come back")
    return cli.status()["worker"]["pid"]


def test_supervisor_kill9_takes_its_children_along(cli):
    out = cli("start")
    assert out.returncode == 0, out.stderr
    pid = cli.status()["worker"]["pid"]
    for _ in range(2):  # the worker crashes twice: the supervisor records 2 restarts
        os.kill(pid, signal.SIGKILL)
        pid = _wait_restarted(cli, pid)
    state = _state(cli)
    sup, worker, cache = state["supervisor_pid"], state["children"]["worker"]["pid"], state["children"]["cache"]["pid"]
    assert state["children"]["worker"]["restarts"] == 2 and worker == pid
    cli.pids = [worker, cache]

    os.kill(sup, signal.SIGKILL)
    try:  # each stops as SIGTERM stops it, or exits hard after the lifeline's grace
        wait_until(lambda: _gone(worker) and _gone(cache), lifeline.GRACE_S + 10,
                   "the worker and the cache process to end with the supervisor")
    except AssertionError:
        raise AssertionError(f"still running after the supervisor died: {_ps(worker, cache)}\n{_log_tail(cli)}") from None
    st = cli("status")
    assert st.returncode == 3 and "not running" in st.stdout
    assert cli.status()["supervisor_pid"] is None

    again = cli("start")  # its leftover supervisor.json (2 restarts) does not count against this one
    assert again.returncode == 0, again.stderr
    assert "dflashd started" in again.stdout
    wait_until(lambda: cli.status()["worker"]["l2_cache"] == "up", 20, "the new cache process")  # it got its lock
    state = _state(cli)
    assert state["supervisor_pid"] != sup and state["children"]["worker"]["restarts"] == 0
    cli.pids = [state["supervisor_pid"], *(c["pid"] for c in state["children"].values())]
    assert cli("stop").returncode == 0
    wait_until(lambda: all(_gone(p) for p in cli.pids), 30, "everything to stop")


def _loose(root: Path) -> dict[str, str]:
    """Paths under root (and root) that others could read or enter: directories not 0700, other
    files (sockets included) not 0600."""
    out = {}
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        if mode != (0o700 if p.is_dir() else 0o600):
            out[str(p.relative_to(root))] = oct(mode)
    return out


def test_everything_the_daemon_writes_is_private(cli):
    """Issue point 3: under umask 022, a start, two jobs (streamed, detached) and a stop leave only
    0700 directories and 0600 files: runtime dir, job store, results, cache, logs, and the parents
    of a state dir that did not exist. Before: 0755 directories, 0644 sqlite, pid, lock and log files."""
    state = cli.dir / "deep" / "er" / "state"
    cli.flags[cli.flags.index("--state-dir") + 1] = str(state)
    out = cli("start")
    assert out.returncode == 0, out.stderr
    with DFlashClient(cli.status()["endpoint"], timeout=20) as c:
        assert len(c.generate(PROMPTS[0], max_tokens=3).token_ids) == 3
        assert len(c.submit(PROMPTS[1], max_tokens=3).result(timeout=60).token_ids) == 3
    running = _loose(cli.dir)  # sockets, WAL files and pid files exist only now
    assert (cli.dir / "run" / "worker.sock").exists() and (state / "jobs" / "cache.db-wal").exists()
    assert cli("stop").returncode == 0
    written = {str(p.relative_to(cli.dir)) for p in cli.dir.rglob("*")}
    assert {"run/supervisor.lock", "run/worker.lock", "deep/er/state/jobs/cache.db", "deep/er/state/logs/dflashd.log",
            "deep/er/state/cache/snapshots/cache.db"} <= written, written
    assert not running and not _loose(cli.dir), (running, _loose(cli.dir))


def test_private_dir_makes_missing_parents_private(tmp_path):
    """Also in a process that did not set the umask (a library caller): parents it creates are
    0700, parents that existed are left as they were."""
    os.chmod(tmp_path, 0o755)
    old = os.umask(0o022)
    try:
        paths.private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    assert _loose(tmp_path) == {".": "0o755"}


def test_stop_and_start_clear_what_a_dead_supervisor_left(cli):
    """Children without a lifeline (as an older version left them) and stale state files whose
    pids now belong to other processes: stop ends the orphan, status and start are not misled."""
    run, state_dir = cli.dir / "run", cli.dir / "state"
    run.mkdir(mode=0o700)
    orphan = subprocess.Popen([sys.executable, "-m", "dflash.cache.l2", "--dir", str(state_dir / "cache"),
                               "--endpoint", f"ipc://{run}/cache.sock"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stranger = subprocess.Popen(["sleep", "300"])  # a live process that now has the dead supervisor's pid
    cli.pids = [orphan.pid, stranger.pid]
    try:
        wait_until(lambda: (state_dir / "cache" / "l2.lock").exists() and (run / "cache.sock").exists(), 20, "the orphan")
        (run / "supervisor.pid").write_text(str(stranger.pid))
        (run / "supervisor.json").write_text(json.dumps({"supervisor_pid": stranger.pid, "children": {
            "worker": {"pid": None, "restarts": 2, "last_rc": -9}, "cache": {"pid": orphan.pid, "restarts": 0}}}))

        st = cli("status")
        assert st.returncode == 3 and "not running" in st.stdout and "supervisor" not in st.stdout
        stop = cli("stop")
        assert stop.returncode == 0, stop.stderr
        assert f"cache pid {orphan.pid}" in stop.stdout
        assert orphan.wait(10) == 0  # asked to stop (SIGTERM), it stopped cleanly
        assert stranger.poll() is None  # not ours: left alone
        assert not (run / "supervisor.json").exists()

        out = cli("start")
        assert out.returncode == 0, out.stderr
        wait_until(lambda: cli.status()["worker"]["l2_cache"] == "up", 20, "the new cache process")
    finally:
        stranger.kill()
        stranger.wait()
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def _fill_store(directory: Path, n: int) -> tuple[list[str], list[str]]:
    """A job store as a worker leaves it: n detached jobs waiting, n finished results."""
    store = JobStore(directory, retention_s=3600)
    waiting, done = [], []
    for i in range(n):
        job = Job(f"wait-{i}", store.next_seq(), {"text": PROMPTS[i % 10], "max_tokens": 2}, stream=False)
        store.save(job)
        waiting.append(job.job_id)
        store.finish(f"done-{i}", {"v": 2, "type": "done", "job_id": f"done-{i}", "text": "ok", "token_ids": [1],
                                   "stats": {}, "finish_reason": "length"})
        done.append(f"done-{i}")
    store.close()
    return waiting, done


def test_damaged_job_store_is_moved_aside(cli):
    """`truncate -s 50%` of the job store: the daemon starts, says what happened, keeps the copy,
    and the jobs and results on the pages that are left are kept intact (before: none were)."""
    jobs_dir = cli.dir / "state" / "jobs"
    waiting, done = _fill_store(jobs_dir, 150)
    db = jobs_dir / "cache.db"
    os.truncate(db, db.stat().st_size // 2)
    damaged = db.read_bytes()

    out = cli("start")
    assert out.returncode == 0, out.stderr
    assert "job store was damaged (database disk image is malformed)" in out.stderr
    aside = list(jobs_dir.parent.glob("jobs.damaged-*"))
    assert len(aside) == 1 and (aside[0] / "cache.db").read_bytes() == damaged  # kept as found
    (note,) = cli.status()["worker"]["job_store"]
    assert note["moved_to"] == str(aside[0]) and "malformed" in note["reason"]
    assert f"the damaged copy is kept in {aside[0]}" in cli("status").stdout
    client_status = subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", cli.status()["endpoint"],
                                    "status"], capture_output=True, text=True, timeout=60).stdout
    assert re.search(rf"^job store note +job store was damaged .*kept in {re.escape(str(aside[0]))}", client_status, re.M)
    log = (cli.dir / "state" / "logs" / "dflashd.log").read_text()
    assert f"job store {jobs_dir} is damaged" in log and str(aside[0]) in log and "L2" not in log
    with DFlashClient(cli.status()["endpoint"], timeout=20) as c:
        assert len(c.generate(PROMPTS[0], max_tokens=3).token_ids) == 3  # a fresh store serves
        kept_jobs, kept_results = [], []
        for job_id in waiting + done:
            try:
                res = c.job(job_id).result(timeout=60)  # a kept detached job has run again by now
            except NotFoundError:
                continue
            (kept_jobs if job_id in waiting else kept_results).append(job_id)
            if job_id in done:  # exactly as stored
                assert (res.text, res.token_ids, res.finish_reason) == ("ok", [1], "length")
            else:
                assert len(res.token_ids) == 2 and res.finish_reason == "length"
    assert kept_jobs and kept_results and len(kept_jobs) + len(kept_results) == note["salvaged"]


def test_readable_jobs_of_a_damaged_store_are_kept(tmp_path):
    """The table page holding a job in the middle overwritten: the scan goes on past it, so the rows
    on every other page are kept (before: none after it), the kept jobs are recovered in their
    order, the results fetchable."""
    jobs_dir = tmp_path / "jobs"
    waiting, done = _fill_store(jobs_dir, 150)
    db = jobs_dir / "cache.db"
    data = db.read_bytes()
    at = data.index(msgpack.packb({"job_id": "wait-75"})[1:])  # inside wait-75's record: a table page
    with open(db, "r+b") as f:
        f.seek(at // 4096 * 4096)
        f.write(b"\xff" * 4096)
    store = JobStore(jobs_dir, retention_s=3600)
    try:
        (note,) = store.notes()
        assert Path(note["moved_to"]).name.startswith("jobs.damaged-") and 250 < note["salvaged"] < 300
        assert not store.has_job("wait-75") and store.has_job("wait-149") and store.result("done-149")
        jobs, _ = store.recover(3)
        kept = [j.job_id for j in jobs]
        assert kept and kept == [j for j in waiting if j in kept]  # queue order
        results = [j for j in done if store.result(j) is not None]
        assert len(kept) + len(results) == note["salvaged"]
        assert store.next_seq() > max(int(j.split("-")[1]) for j in kept) + 1  # after the kept ones
    finally:
        store.close()


def test_garbage_job_store_is_replaced(tmp_path):
    jobs_dir = tmp_path / "jobs"
    _fill_store(jobs_dir, 3)
    (jobs_dir / "cache.db").write_bytes(os.urandom(5000))
    store = JobStore(jobs_dir, retention_s=3600)
    try:
        (note,) = store.notes()
        assert note["salvaged"] == 0 and "not a database" in note["reason"]
        assert store.recover(3) == ([], [])
        assert Path(note["moved_to"]).name.startswith("jobs.damaged-")
        store.save(Job("new", store.next_seq(), {"text": "hi"}))
        assert [j.job_id for j in store.recover(3)[0]] == ["new"]
    finally:
        store.close()


def test_job_store_is_msgpack_and_never_unpickles(tmp_path):
    jobs_dir = tmp_path / "jobs"
    _fill_store(jobs_dir, 2)
    with sqlite3.connect(jobs_dir / "cache.db") as con:
        rows = con.execute("SELECT key, mode, value FROM Cache WHERE key LIKE 'job:%' OR key LIKE 'result:%'").fetchall()
    assert len(rows) == 4 and all(mode == 1 for _, mode, _ in rows)  # raw bytes, not pickle (4)
    assert all(isinstance(msgpack.unpackb(v), dict) for _, _, v in rows)

    import diskcache  # a record pickled as older versions did, built to leave a trace when unpickled

    trace = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (Path.touch, (trace,))

    old = diskcache.Cache(str(jobs_dir))
    old.set("job:old", Trap())
    old.close()
    assert pickle.loads(pickle.dumps(Trap())) is None and trace.exists()  # the trap works
    trace.unlink()
    store = JobStore(jobs_dir, retention_s=3600)
    try:
        jobs, _ = store.recover(3)
        assert sorted(j.job_id for j in jobs) == ["wait-0", "wait-1"]
        assert not trace.exists() and not store.known("old")  # dropped, never unpickled
    finally:
        store.close()


def test_jobs_whose_client_left_are_held_not_rerun(make_daemon, tiny_pair):  # noqa: F811
    d = make_daemon(max_attempts=3)
    c = d.client(timeout=60)
    pid = d.worker_pid()
    stream = c.stream(PROMPTS[0], max_tokens=8000)  # running when the worker dies; long
    it = iter(stream)
    next(it)
    shell = [sys.executable, "-m", "dflash.client.cli", "--endpoint", d.endpoint]
    shells = [subprocess.Popen([*shell, "prompt", "--max-tokens", "40", PROMPTS[i]], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    wait_until(lambda: len(c.jobs()) == 3, 30, "the shells' jobs to queue")
    shell_jobs = [j["job_id"] for j in c.jobs() if j["job_id"] != stream.job_id]
    detached = c.submit(PROMPTS[3], max_tokens=8)

    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerGoneError) as e:
        for _ in it:
            pass
    assert stream.job_id in str(e.value)
    seen = {}  # prompt index -> the job id its shell user was told
    for i, proc in zip((1, 2), shells):
        _, err = proc.communicate(timeout=30)
        told = re.search(r"`dflash-client --endpoint \S+ result (\S+)` runs it again", err)  # how to fetch it
        assert proc.returncode == 3 and told, err
        seen[i] = told.group(1)
    assert sorted(seen.values()) == sorted(shell_jobs)

    # only the detached job runs again; before, the 8000-token stream nobody reads would run first
    assert detached.result(timeout=60).token_ids == reference(tiny_pair, PROMPTS[3], 8)[1]
    st = c.stats()
    assert st["held"] == 3 and st["queued"] == 0 and st["running"] is None and st["recovered"] == 4
    assert {j["job_id"]: j["state"] for j in c.jobs()} == dict.fromkeys([stream.job_id, *shell_jobs], "held")
    assert len(c.generate(PROMPTS[4], max_tokens=4).token_ids) == 4  # nothing blocks the queue
    status = subprocess.run([*shell, "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and re.search(r"^held +3$", status.stdout, re.M), status.stdout

    # the shell user fetches one by id, as the error said: it runs now, and prints as `prompt` would have
    out = subprocess.run([*shell, "result", seen[1]], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference(tiny_pair, PROMPTS[1], 40)[0] + "\n"
    as_json = subprocess.run([*shell, "result", "--json", seen[1]], capture_output=True, text=True, timeout=60)
    assert json.loads(as_json.stdout)["token_ids"] == reference(tiny_pair, PROMPTS[1], 40)[1]
    for job_id, code, what in (("no-such-job", 5, "[not_found]"), ("bad id", 2, "[bad_request]")):
        out = subprocess.run([*shell, "result", job_id], capture_output=True, text=True, timeout=60)
        assert out.returncode == code and out.stderr.startswith(f"dflash-client: {what}"), out.stderr
        assert out.stderr.count("\n") == 1 and not out.stdout
    # a client that is still there re-sends its submit: the job runs, streamed to it
    again = c.stream(PROMPTS[2], max_tokens=40, job_id=seen[2])
    assert "".join(delta.text for delta in again) == again.result.text
    assert again.result.token_ids == reference(tiny_pair, PROMPTS[2], 40)[1]
    assert c.cancel(stream.job_id)["cancelled"] and c.status(stream.job_id).state == "cancelled"
    assert c.stats()["held"] == 0 and not c.jobs()
    c.close()
