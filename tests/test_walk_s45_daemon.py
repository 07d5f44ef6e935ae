"""Walkthrough s45 fixes: empty stop strings at the gateway, `dflashd install --dest` keeping to
its folder, `make demo` passing the prompt intact, a quiet editable install, and Ctrl-C's error
line on a redirected `dflash-client prompt`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.daemon import protocol as P
from dflash.daemon.cli import main as dflashd
from daemon_fixtures import interrupt_waiting_client
from test_gateway_errors import _Server, _error, _parse, _request

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gateway():
    s = _Server()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
@pytest.mark.parametrize("stop", ["", ["", "a"], ["a", ""]])
def test_gateway_refuses_an_empty_stop_as_the_clis_do(gateway, path, extra, stop):
    body = json.dumps({**extra, "max_tokens": 2, "stop": stop}).encode()
    status, _, reply = _parse(gateway.raw(_request("POST", path, body, {"Content-Type": "application/json"})))
    err = _error(reply)
    assert status == 400 and err["param"] == "stop" and err["type"] == "invalid_request_error", (status, err)
    assert "cannot be empty" in err["message"], err


def test_one_stop_check_for_daemon_gateway_and_client():
    assert P.stops_problem([]) is None and P.stops_problem(["a"]) is None
    assert P.stops_problem([""]) == "a stop sequence cannot be empty"
    assert "at most" in P.stops_problem(["a"] * (P.MAX_STOPS + 1))


def _home(tmp_path, monkeypatch) -> Path:
    """A home of the test's own: nothing may touch the real ~/.local/state or ~/.config."""
    home = tmp_path / "home"
    home.mkdir()
    for var, sub in (("HOME", ""), ("XDG_STATE_HOME", ".local/state"), ("XDG_CONFIG_HOME", ".config"),
                     ("XDG_RUNTIME_DIR", "run"), ("XDG_CACHE_HOME", ".cache")):
        monkeypatch.setenv(var, str(home / sub))
    for var in [v for v in os.environ if v.startswith("DFLASH_")]:
        monkeypatch.delenv(var)
    return home


@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_install_dest_writes_only_into_dest_and_uninstall_removes_it(tmp_path, monkeypatch, kind):
    home = _home(tmp_path, monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    dest = tmp_path / "units"
    res = CliRunner().invoke(dflashd, ["install", "--kind", kind, "--dest", str(dest), "--no-load",
                                       "--model", str(model)])
    assert res.exit_code == 0, res.output
    assert f"config: {dest / 'daemon.json'}" in res.output, res.output
    assert not [p for p in home.rglob("*") if p.is_file()], "install --dest wrote outside DIR"
    assert json.loads((dest / "daemon.json").read_text())["model"] == str(model)
    res = CliRunner().invoke(dflashd, ["uninstall", "--kind", kind, "--dest", str(dest), "--no-load"])
    assert res.exit_code == 0 and f"removed {dest / 'daemon.json'}" in res.output, res.output
    assert not list(dest.iterdir()), list(dest.iterdir())


def test_uninstall_keeps_a_config_of_the_users_own(tmp_path, monkeypatch):
    """Only the daemon.json install wrote goes: a unit edited to run on another file leaves it."""
    _home(tmp_path, monkeypatch)
    own = tmp_path / "mine.json"
    own.write_text("{}")
    dest = tmp_path / "units"
    dest.mkdir()
    (dest / "dflashd.service").write_text(f"[Service]\nExecStart=/x -m dflash.daemon.supervisor --config-json @{own}\n")
    res = CliRunner().invoke(dflashd, ["uninstall", "--kind", "systemd", "--dest", str(dest), "--no-load"])
    assert res.exit_code == 0 and own.exists() and not (dest / "dflashd.service").exists(), res.output


def test_make_demo_passes_the_prompt_through_intact(tmp_path):
    """`make demo DEMO_PROMPT=...`: quotes, `$` and backticks reach dflash-client as typed (the
    installs and the import are assumed done: -o; the tools are stand-ins that record argv)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    got = tmp_path / "argv.json"
    for tool in ("dflashd", "dflash-client"):
        script = venv / "bin" / tool
        script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                          f"if sys.argv[1:2] == ['prompt']: open({str(got)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
        script.chmod(0o755)
    prompt = """Say "hi" $HOME `echo x` 'q' $(y) $$ \\n"""
    models = tmp_path / "models"
    out = subprocess.run(["make", "-s", "demo", f"VENV={venv}", f"MODELS={models}", f"DEMO_PROMPT={prompt}",
                          "-o", f"{venv}/.fastcpu", "-o", f"{models}/SmolLM2-135M-Instruct/config.json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(got.read_text())[-1] == prompt


@pytest.mark.parametrize("args", [["prompt", "hello"], ["result", "j1"]])
def test_ctrl_c_with_output_redirected_starts_no_empty_line(tmp_path, args):
    """Ctrl-C on `dflash-client prompt > file` (stderr a file too): the line on stderr is the
    first, as after a worker error, not preceded by an empty one. The endpoint is a TCP listener
    that never answers, so the command is waiting when the signal comes."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
           "XDG_CONFIG_HOME": str(tmp_path / "config")}  # no user config file either
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        code, _, _ = interrupt_waiting_client(args, env, out, err, settle=0.3)  # into the wait for the answer
    text = (tmp_path / "err").read_text()
    assert code == 130, (code, text)
    assert text.startswith("dflash-client: ") and text.count("\n") == 1, repr(text)
    assert (tmp_path / "out").read_bytes() == b""


def test_pyproject_builds_without_setuptools_warnings():
    """The two warnings `make demo`'s editable install printed: a TOML-table license (deprecated
    for an SPDX string) and engine/drafts shipped as data of a package not in `packages`."""
    from dflash.daemon.config import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    assert "dflash.engine.drafts" in project["tool"]["setuptools"]["packages"]
    data = project["tool"]["setuptools"]["package-data"]
    assert data["dflash.engine.drafts"] and not any("drafts" in p for p in data.get("dflash.engine", []))


def test_install_relative_dest_names_an_absolute_config(tmp_path, monkeypatch):
    """The unit starts in /: the daemon.json a relative --dest holds is named by its full path."""
    _home(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    res = CliRunner().invoke(dflashd, ["install", "--kind", "systemd", "--dest", "units", "--no-load",
                                       "--model", str(tmp_path / "model")])
    assert res.exit_code == 0, res.output
    assert f"--config-json @{tmp_path / 'units' / 'daemon.json'}\n" in (tmp_path / "units" / "dflashd.service").read_text()
