"""`dflashd` itself: start (detached) / status / stop, and install rendering launchd plists and a
systemd unit that really start a worker."""

from __future__ import annotations

import json
import plistlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_fixtures import PROMPTS, make_daemon, tiny_pair  # noqa: F401

from dflash.client import DFlashClient
from dflash.daemon.cli import main as dflashd


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
    assert f"ExecStart={sys.executable} -m dflash.daemon.supervisor --config-json @{d / 'state' / 'daemon.json'}" in unit
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=2 3" in unit and "UMask=0077" in unit
    assert not re.search(r"@[A-Z_]+@", unit) and not re.search(rb"@[A-Z_]+@", (tmp_path / "com.dflash.worker.plist").read_bytes())
    assert not re.search(rb"@[A-Z_]+@", (tmp_path / "com.dflash.cache.plist").read_bytes())
    res = CliRunner().invoke(dflashd, ["uninstall", "--kind", "launchd", "--dest", str(tmp_path), "--no-load"])
    assert "removed" in res.output and not (tmp_path / "com.dflash.worker.plist").exists()


def test_model_that_fails_to_load_is_reported(dirs, tmp_path):
    flags, _ = dirs
    out = _dflashd("start", "--model", str(tmp_path / "missing"), "--draft", str(tmp_path / "missing"), *flags, timeout=60)
    try:
        assert out.returncode != 0 and "failed to load" in out.stderr
    finally:
        _dflashd("stop", *flags)


def test_tcp_with_curve_keys(make_daemon, tmp_path):  # noqa: F811
    import socket

    import zmq.auth

    from dflash.client import WorkerUnavailableError

    server_pub, server_sec = zmq.auth.create_certificates(str(tmp_path), "server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon(endpoint=f"tcp://127.0.0.1:{port}", curve_server_secret=server_sec, curve_server_public=server_pub)
    with d.client(timeout=20) as c:  # the daemon's config names the public cert: CURVE on
        assert len(c.generate(PROMPTS[0], max_tokens=4).token_ids) == 4
    with DFlashClient(d.endpoint, timeout=1.5) as plain:
        with pytest.raises(WorkerUnavailableError):  # no keys: the handshake never completes
            plain.stats()
