"""`dflashd` itself: start (detached) / status / stop, and install rendering launchd plists and a
systemd unit that really start a worker."""

from __future__ import annotations

import json
import plistlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_fixtures import PROMPTS, make_daemon, tiny_pair, wait_until  # noqa: F401

from dflash.client import DFlashClient
from dflash.daemon.cli import main as dflashd
from dflash.daemon.config import DaemonConfig
from dflash.daemon.supervisor import lock_held


@pytest.fixture
def dirs():
    d = Path(tempfile.mkdtemp(prefix="dfc", dir="/tmp"))
    yield ["--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")], d
    shutil.rmtree(d, ignore_errors=True)


def _dflashd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.daemon.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_start_status_stop(tiny_pair, dirs):  # noqa: F811
    flags, d = dirs
    model, draft = tiny_pair
    out = _dflashd("start", "--model", model, "--draft", draft, "--blas", "auto", *flags)
    try:
        assert out.returncode == 0, out.stderr
        assert "dflashd started" in out.stdout
        again = _dflashd("start", "--model", model, "--draft", draft, *flags)
        assert again.returncode != 0 and "already running" in again.stderr
        st = json.loads(_dflashd("status", "--json", *flags).stdout)
        assert st["worker"]["state"] == "ready" and st["supervisor_pid"]
        accel = st["worker"]["accel"]  # what the worker chose for this machine
        mkl = list((Path(sys.prefix) / "lib").glob("libmkl_rt.so.*"))
        assert accel.startswith("mkl") if (mkl and sys.platform == "linux") else accel
        with DFlashClient(st["endpoint"], timeout=20) as c:
            assert len(c.generate(PROMPTS[0], max_tokens=5).token_ids) == 5
        text = _dflashd("status", *flags).stdout  # the limits a request must fit, in words
        assert "limits: max_tokens 8192, prompt 32768 tokens, request 1024 KiB, 3 attempts a job" in text, text
        logs = _dflashd("logs", "-n", "20", *flags)
        assert "listening on" in logs.stdout
    finally:
        stop = _dflashd("stop", *flags)
    assert stop.returncode == 0, stop.stderr
    assert _dflashd("status", *flags).returncode == 3
    assert not (d / "run" / "supervisor.pid").exists()


def test_install_renders_valid_plists_that_start_a_worker(tiny_pair, dirs, tmp_path):  # noqa: F811
    flags, d = dirs
    model, draft = tiny_pair
    res = CliRunner().invoke(dflashd, ["install", "--kind", "launchd", "--dest", str(tmp_path), "--no-load",
                                       "--model", model, "--draft", draft, "--blas", "none", *flags])
    assert res.exit_code == 0, res.output
    plist = plistlib.loads((tmp_path / "com.dflash.worker.plist").read_bytes())
    assert plist["Label"] == "com.dflash.worker"
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["ThrottleInterval"] > 0
    assert plist["Umask"] == 0o077  # launchd's own log files are private too
    assert plist["StandardOutPath"] == str(d / "state" / "logs" / "worker.log")
    assert plist["EnvironmentVariables"]["DFLASH_STATE_DIR"] == str(d / "state")
    args = plist["ProgramArguments"]
    assert args[:3] == [sys.executable, "-m", "dflash.daemon.worker"] and args[3] == "--config-json"
    cfg = json.loads(Path(args[4][1:]).read_text())
    assert cfg["model"] == model and cfg["endpoint"].startswith("ipc://")
    cache = plistlib.loads((tmp_path / "com.dflash.cache.plist").read_bytes())
    assert cache["ProgramArguments"][:3] == [sys.executable, "-m", "dflash.cache.l2"] and cache["Umask"] == 0o077
    assert cache["ProgramArguments"][3:7] == ["--dir", cfg["cache_dir"], "--endpoint", cfg["cache_endpoint"]]

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # as launchd would
    try:
        with DFlashClient(cfg["endpoint"], timeout=60) as c:
            end = time.monotonic() + 60
            while c.stats()["state"] != "ready" and time.monotonic() < end:
                time.sleep(0.1)
            assert len(c.generate(PROMPTS[1], max_tokens=4).token_ids) == 4
            c.shutdown()
        assert proc.wait(30) == 0  # exit 0: KeepAlive/SuccessfulExit=false leaves it stopped
    finally:
        if proc.poll() is None:
            proc.kill()

    res = CliRunner().invoke(dflashd, ["install", "--kind", "systemd", "--dest", str(tmp_path), "--no-load",
                                       "--model", model, *flags])
    assert res.exit_code == 0, res.output
    unit = (tmp_path / "dflashd.service").read_text()
    assert f"ExecStart={sys.executable} -m dflash.daemon.supervisor --config-json @{tmp_path / 'daemon.json'}" in unit  # --dest: all of it in DIR
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=2 3" in unit and "UMask=0077" in unit
    assert not re.search(r"@[A-Z_]+@", unit) and not re.search(rb"@[A-Z_]+@", (tmp_path / "com.dflash.worker.plist").read_bytes())
    assert not re.search(rb"@[A-Z_]+@", (tmp_path / "com.dflash.cache.plist").read_bytes())
    res = CliRunner().invoke(dflashd, ["uninstall", "--kind", "launchd", "--dest", str(tmp_path), "--no-load"])
    assert "removed" in res.output and not (tmp_path / "com.dflash.worker.plist").exists()


def test_install_pins_relative_paths_and_writes_private_files(tiny_pair, dirs):  # noqa: F811
    """Paths given relative to where `dflashd install` ran still work for a service started in /,
    and everything install writes is 0600."""
    _, d = dirs
    (d / "models").mkdir()
    (d / "models" / "tiny").symlink_to(tiny_pair[0])  # a link is kept, not resolved
    out = subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "install", "--kind", "systemd", "--dest", "units",
                          "--no-load", "--model", "models/tiny", "--draft", "models/tiny/draft", "--blas", "none",
                          "--runtime-dir", "run", "--state-dir", "state"], cwd=d, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    config = d / "units" / "daemon.json"  # --dest: install writes only into DIR
    cfg = json.loads(config.read_text())
    assert cfg["model"] == str(d / "models" / "tiny") and cfg["draft"] == str(d / "models" / "tiny" / "draft")
    assert cfg["runtime_dir"] == str(d / "run") and cfg["endpoint"] == f"ipc://{d / 'run' / 'worker.sock'}"
    assert cfg["state_dir"] == str(d / "state") and cfg["cache_dir"] == str(d / "state" / "cache")
    unit = d / "units" / "dflashd.service"
    for path in (unit, config):
        assert path.stat().st_mode & 0o777 == 0o600, path
    start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    proc = subprocess.Popen(start[len("ExecStart="):].split(), cwd="/", stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # as systemd would run it
    try:
        with DFlashClient(cfg["endpoint"], timeout=60) as c:
            wait_until(lambda: c.stats()["state"] != "loading", 60, "the installed daemon to load its model")
            assert c.stats()["state"] == "ready"
    finally:
        proc.terminate()
        proc.wait(60)
    res = CliRunner().invoke(dflashd, ["install", "--kind", "launchd", "--dest", str(d / "units"), "--no-load",
                                       "--model", tiny_pair[0], "--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")])
    assert res.exit_code == 0, res.output
    for plist in (d / "units").glob("*.plist"):
        assert plist.stat().st_mode & 0o777 == 0o600, plist


def _nothing_running(d: Path) -> None:
    """No supervisor, worker or cache process of the daemon in `d` is left (each holds its lock
    for its whole life)."""
    for lock in ("run/supervisor.lock", "run/worker.lock", "state/cache/l2.lock"):
        assert not lock_held(d / lock), f"{lock} is still held"


def _error_line(out: subprocess.CompletedProcess) -> str:
    """The one line a failed command prints (no traceback)."""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    return lines[0]


def test_model_that_fails_to_load_is_reported_and_stopped(tiny_pair, dirs, tmp_path):  # noqa: F811
    """The failed start stops all it started: the next start with a good model just works."""
    flags, d = dirs
    try:
        out = _dflashd("start", "--model", str(tmp_path / "missing"), "--draft", str(tmp_path / "missing"), *flags, timeout=60)
        assert out.returncode == 1
        line = _error_line(out)
        assert "failed to load: ModelNotFoundError" in line and line.endswith("; the daemon was stopped")
        _nothing_running(d)
        status = _dflashd("status", *flags)
        assert status.returncode == 3 and "not running" in status.stdout
        again = _dflashd("start", "--model", tiny_pair[0], "--draft", tiny_pair[1], "--blas", "none", *flags)
        assert again.returncode == 0 and "dflashd started" in again.stdout, again.stderr
    finally:
        _dflashd("stop", *flags)


# A sitecustomize that ends the worker's process (the lifeline running dflash.daemon.worker) at
# once with exit 1, every time it starts: a real crash at start, whatever its cause.
CRASHING_WORKER = """import os
cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if b"dflash.daemon.lifeline" in cmd and b"dflash.daemon.worker" in cmd:
    os._exit(1)
"""


def test_worker_that_keeps_crashing_is_stopped(tiny_pair, dirs, tmp_path):  # noqa: F811
    """A worker that dies at each start: `dflashd start` gives up and stops the supervisor rather
    than leave it restarting the worker forever. (Until session 46 a tcp:// port this test held
    made it crash; that is refused before anything starts now.)"""
    import os

    flags, d = dirs
    model, draft = tiny_pair
    (tmp_path / "sitecustomize.py").write_text(CRASHING_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "start", "--model", model, "--draft", draft,
                          "--blas", "none", *flags], capture_output=True, text=True, timeout=120, env=env)
    try:
        assert out.returncode == 1
        line = _error_line(out)
        assert "the worker keeps crashing" in line and line.endswith("; the daemon was stopped")
        _nothing_running(d)
    finally:
        _dflashd("stop", *flags)


def test_a_tcp_port_another_program_holds_is_refused_before_anything_starts(tiny_pair, dirs):  # noqa: F811
    """It ended in "the worker keeps crashing (2 restarts); see log", the reason (address in use)
    only as a traceback in the log."""
    flags, d = dirs
    model, draft = tiny_pair
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        out = _dflashd("start", "--model", model, "--draft", draft, "--blas", "none", "--endpoint", endpoint, *flags)
        try:
            assert out.returncode == 2, out.stderr
            line = _error_line(out)
            assert endpoint in line and "Address already in use" in line and "another program" in line, line
            _nothing_running(d)
            assert not (d / "run" / "supervisor.pid").exists()
        finally:
            _dflashd("stop", *flags)
    out = _dflashd("start", "--model", model, "--draft", draft, "--blas", "none", "--endpoint", endpoint, *flags)
    try:  # the port freed: the same command starts
        assert out.returncode == 0, out.stderr
    finally:
        _dflashd("stop", "--endpoint", endpoint, *flags)


def test_serve_stops_the_daemon_whose_model_failed_to_load(dirs, tmp_path):
    """`dflash serve` (no --attach) starts the daemon through `dflashd start`: the same clean-up."""
    flags, d = dirs
    cmd = [sys.executable, "-m", "dflash.engine.cli", "serve", "--port", "0", "--model", str(tmp_path / "missing"),
           "--draft", str(tmp_path / "missing"), *flags]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and _error_line(out).endswith("; the daemon was stopped")
        _nothing_running(d)
    finally:
        _dflashd("stop", *flags)


def test_status_text_says_why_the_model_failed(dirs, tmp_path):
    """A daemon left in the failed state (a supervisor without exit_on_load_failure, which
    `dflashd start --foreground` sets: tests/test_start_failures.py)."""
    flags, d = dirs
    missing = str(tmp_path / "missing")
    cfg = DaemonConfig(model=missing, draft=missing, runtime_dir=str(d / "run"), state_dir=str(d / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "dflash.daemon.supervisor", "--config-json", cfg.to_json()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def failed() -> bool:
            out = _dflashd("status", "--json", *flags)
            return out.returncode == 0 and json.loads(out.stdout)["worker"]["state"] == "failed"

        wait_until(failed, 60, "the worker to report its failed load", poll_s=0.5)
        error = json.loads(_dflashd("status", "--json", *flags).stdout)["worker"]["error"]
        first = _dflashd("status", *flags).stdout.splitlines()[0]
        assert first == f"dflashd: failed at ipc://{d / 'run' / 'worker.sock'} : {error}"
        assert error.startswith("ModelNotFoundError: ")
    finally:
        proc.terminate()
        proc.wait(60)


def _toml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_verify_window_the_draft_cannot_take_fails_the_start(tiny_pair, dirs, tmp_path):  # noqa: F811
    """Checked against the loaded draft's block (16 tokens): a configuration error, not a
    bad_request on every later prompt."""
    flags, d = dirs
    bad = _toml(tmp_path / "bad.toml", f'model = "{tiny_pair[0]}"\ndraft = "{tiny_pair[1]}"\nblas = "none"\n'
                                        "verify_window = 99\n")
    try:
        out = _dflashd("start", "--config", bad, *flags)
        assert out.returncode == 2
        line = _error_line(out)
        assert "ConfigError: verify_window = 99 in the daemon's configuration" in line
        assert "verify window 99 is larger than this draft's block of 16 tokens" in line
        assert line.endswith("; the daemon was stopped")
        _nothing_running(d)
    finally:
        _dflashd("stop", *flags)


@pytest.mark.parametrize("toml, name", [("[generation]\ntop_p = 5", "top_p"), ("[generation]\ntemperature = -1", "temperature"),
                                        ("verify_window = 0", "verify_window"), ("max_queue = 0", "max_queue")])
def test_bad_setting_in_the_config_file_exits_2(dirs, tmp_path, toml, name):
    """docs/daemon.md: a bad value is a configuration error, exit 2 (as the worker's own)."""
    flags, d = dirs
    bad = _toml(tmp_path / "bad.toml", f'model = "{tmp_path}"\n{toml}\n')
    for command in ("start", "status"):
        out = _dflashd(command, "--config", bad, *flags)
        assert out.returncode == 2 and name in _error_line(out)
    assert not (d / "run").exists()  # refused before anything started


def test_a_tcp_port_a_dead_supervisors_worker_held_is_taken_back(tiny_pair, dirs):  # noqa: F811
    """The port check runs after the orphans of a dead supervisor are stopped: their port is ours."""
    import os
    import signal

    flags, d = dirs
    model, draft = tiny_pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    args = ["--model", model, "--draft", draft, "--blas", "none", "--endpoint", endpoint, *flags]
    try:
        assert _dflashd("start", *args).returncode == 0
        os.kill(int((d / "run" / "supervisor.pid").read_text()), signal.SIGKILL)
        out = _dflashd("start", *args)
        assert out.returncode == 0, out.stderr
        assert DFlashClient(endpoint, timeout=30).stats()["state"] == "ready"
    finally:
        _dflashd("stop", *args)
