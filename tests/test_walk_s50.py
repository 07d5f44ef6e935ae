"""Session 50's README walk-through from a clean clone: what a newcomer hit, kept fixed.

- `dflashd status` said nothing of the model it serves (its --help promises "pid, model, ..."),
  and a second `dflashd start --model OTHER` answered only "already running", not with what and
  not how to replace it.
- A config file with a `[daemon]` table silently dropped everything beside it but `[generation]`
  (a `[generaton]` typo, a `model` written above the table).
- `dflash generate -p ""` loaded the model and then exited 1; dflash-client calls it a bad request (2).
- `dflash-client result ID` of a job cancelled because the client streaming it died blamed
  `dflash-client cancel` or another client.
- A mistyped `--draft` was named "no config.json in draft directory X" for a folder that is not
  there (the target's "model directory not found: X" names it as such).

Real processes: `dflashd` on a tiny pair in its own runtime and state dirs, `dflash generate`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_fixtures import tiny_pair  # noqa: F401


def _env() -> dict[str, str]:
    """No user settings (config file, endpoint) and no BLAS re-exec."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s50-no-config", "DFLASH_BLAS": "none"}


def _run(module: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), stdin=subprocess.DEVNULL)


@pytest.fixture
def dirs():
    d = Path(tempfile.mkdtemp(prefix="dfw", dir="/tmp"))  # short: ipc paths are capped
    yield ["--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")]
    shutil.rmtree(d, ignore_errors=True)


def test_status_names_the_model_and_a_second_start_says_what_runs(tiny_pair, dirs):  # noqa: F811
    model, draft = tiny_pair
    out = _run("dflash.daemon.cli", "start", "--model", model, "--draft", draft, *dirs)
    try:
        assert out.returncode == 0, out.stderr
        text = _run("dflash.daemon.cli", "status", *dirs)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[2] == f"  model {model} (draft {draft}, dtype float32)", text.stdout  # after the pids, before the accelerator
        st = json.loads(_run("dflash.daemon.cli", "status", "--json", *dirs).stdout)
        assert st["model"]["model"] == model and st["model"]["draft"] == draft and st["model"]["loaded"] is True
        again = _run("dflash.daemon.cli", "start", "--model", model + "-other", *dirs)
        assert again.returncode == 1, again.stderr
        err = again.stderr.strip()
        assert err.startswith("Error: dflashd is already running at ipc://"), err
        assert f"serving model {model} (draft {draft}, dtype float32)" in err and "`dflashd restart`" in err, err
        assert "\n" not in err and "Traceback" not in again.stderr
    finally:
        stop = _run("dflash.daemon.cli", "stop", *dirs)
    assert stop.returncode == 0, stop.stderr
    gone = _run("dflash.daemon.cli", "status", "--json", *dirs)
    assert gone.returncode == 3 and json.loads(gone.stdout)["model"] is None


def test_a_missing_draft_directory_is_named_as_such(tiny_pair, tmp_path):  # noqa: F811
    model, _ = tiny_pair
    missing = tmp_path / "no-such-draft"
    out = _run("dflash.engine.cli", "generate", "--model", model, "--draft", str(missing), "-p", "hi", "-m", "2")
    assert out.returncode == 1 and out.stderr.strip() == f"Error: draft directory not found: {missing}", out.stderr
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a draft")
    out = _run("dflash.engine.cli", "generate", "--model", model, "--draft", str(a_file), "-p", "hi", "-m", "2")
    assert out.returncode == 1 and out.stderr.strip() == f"Error: {a_file} is a file, not a draft directory", out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run("dflash.engine.cli", "generate", "--model", model, "--draft", str(empty), "-p", "hi", "-m", "2")
    assert out.returncode == 1 and out.stderr.strip() == f"Error: no config.json in draft directory {empty}", out.stderr


@pytest.mark.parametrize("text, words", [
    ('[daemon]\nmodel = "/m"\n[generaton]\ntemperature = 0.5\n', "got generaton"),  # a typo'd table
    ('model = "/m"\n[daemon]\nmax_queue = 3\n', "got model"),  # a key above the table
    ("daemon = 3\n", "daemon must be a table"),
])
def test_what_stands_beside_a_daemon_table_is_refused_not_dropped(tmp_path, text, words):
    """With a [daemon] table, everything else in the file but [generation] was ignored without a
    word: a `[generaton]` typo left the daemon greedy, a `model` above the table was not used."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    for module, prefix in (("dflash.daemon.cli", "Error: bad config: "), ("dflash.client.cli", "dflash-client: bad config: ")):
        out = _run(module, *(["status", "--config", str(f)] if module == "dflash.daemon.cli"
                             else ["--config", str(f), "status"]))
        line = out.stderr.strip()
        assert out.returncode == 2 and line.startswith(prefix + str(f)) and words in line, out.stderr
        assert "\n" not in line and "Traceback" not in out.stderr


def test_a_daemon_table_with_generation_beside_it_still_loads(tmp_path):
    from dflash.daemon.config import load_config

    f = tmp_path / "c.toml"
    f.write_text('[daemon]\nmodel = "/m"\nmax_queue = 3\n[generation]\ntemperature = 0.5\n')
    cfg = load_config(f, env={})
    assert (cfg.model, cfg.max_queue, cfg.temperature) == ("/m", 3, 0.5)


@pytest.mark.parametrize("args, stdin", [(["-p", ""], None), (["-p", "  \n"], None), ([], b"\n")])
def test_dflash_generate_refuses_an_empty_prompt_before_loading(tmp_path, args, stdin):
    """`dflash generate -p ""` loaded the model, then exited 1 ("Error: empty prompt"); dflash-client
    refuses it as a bad request (2). Now 2, before any load: the model here does not exist."""
    out = subprocess.run([sys.executable, "-m", "dflash.engine.cli", "generate", "--model", str(tmp_path / "none"),
                          *args], capture_output=True, timeout=60, env=_env(), input=stdin,
                         stdin=subprocess.DEVNULL if stdin is None else None)
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and err == "Error: empty prompt: give --prompt TEXT, or pipe it on stdin", err


def test_result_of_a_job_whose_streaming_client_died_says_why_it_was_cancelled(tiny_pair):  # noqa: F811
    """`dflash-client result ID` for a job whose `prompt` was killed mid-stream (so the worker
    cancelled it) said "cancelled (dflash-client cancel, or another client)": neither happened."""
    from daemon_fixtures import running, wait_until

    for d in running(tiny_pair):
        env = {**_env(), "DFLASH_ENDPOINT": d.endpoint}
        proc = subprocess.Popen([sys.executable, "-m", "dflash.client.cli", "prompt", "--raw", "-m", "4000",
                                 "Tell me about the sea."], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=env, stdin=subprocess.DEVNULL)
        try:
            with d.client(timeout=10) as c:
                wait_until(lambda: any(j.get("state") == "running" for j in c.jobs()), 60, "a running job")
                job_id = next(j["job_id"] for j in c.jobs() if j.get("state") == "running")
                proc.stdout.read(1)  # it streams
        finally:
            proc.kill()
            proc.wait()
        out = subprocess.run([sys.executable, "-m", "dflash.client.cli", "result", job_id], capture_output=True,
                             text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert out.returncode == 6, (out.returncode, out.stderr)
        assert out.stderr.strip().endswith("or the client streaming it went away): the text is cut short"), out.stderr
