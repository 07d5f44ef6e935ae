"""`dflash make-tiny` and `dflash generate` as a new user meets them: bad values are one-line
errors with the right exit status, nothing is overwritten by accident, and Ctrl-C keeps what was
generated (real processes, real SIGINT, a tiny random-weight model made by the command itself).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.engine.cli import main

CLI = [sys.executable, "-m", "dflash.engine.cli"]
NO_REEXEC = {"DFLASH_BLAS": "none"}  # in this process: never the re-exec that preloads a BLAS (accel.py)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3 tiny pair, made the way the README's tour makes one."""
    out = tmp_path_factory.mktemp("walk") / "tiny"
    res = CliRunner(env=NO_REEXEC).invoke(main, ["make-tiny", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _run(args: list[str]) -> tuple[int, str]:
    res = CliRunner(env=NO_REEXEC).invoke(main, args)
    # an uncaught exception (what a user sees as a traceback) is res.exception; a clean exit is SystemExit
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    return res.exit_code, res.output


# --- make-tiny ----------------------------------------------------------------------------------
def test_make_tiny_says_how_to_use_it(tiny: Path) -> None:
    """The printed command runs as printed: the draft is not found by the registry for a tiny
    folder, so the line names it."""
    res = CliRunner(env=NO_REEXEC).invoke(main, ["make-tiny", str(tiny.parent / "my models" / "again"),
                                                  "--arch", "llama"])
    assert res.exit_code == 0, res.output
    cmd = next(line.strip() for line in res.output.splitlines() if line.strip().startswith("dflash generate"))
    code, out = _run([*shlex.split(cmd)[1:-2], "-m", "4", "--json"])
    assert code == 0, out
    assert json.loads(out)["stats"]["generated_tokens"] == 4


def test_make_tiny_refuses_bad_values(tmp_path: Path) -> None:
    code, out = _run(["make-tiny", str(tmp_path / "a"), "--arch", "gpt2"])
    assert code == 2 and "gemma3_text" in out  # the families are listed
    code, out = _run(["make-tiny", str(tmp_path / "b"), "--draft-layers", "0"])
    assert code == 2 and "--draft-layers" in out  # a 0-layer draft crashes generate later
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_make_tiny_never_overwrites_by_accident(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, out = _run(["make-tiny", str(a_file)])
    assert code == 1 and "not a folder" in out and a_file.read_text() == "mine"
    code, out = _run(["make-tiny", str(a_file / "sub")])
    assert code == 1 and "cannot be made" in out
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # e.g. a real model's folder
    code, out = _run(["make-tiny", str(model)])
    assert code == 1 and "--force" in out and (model / "config.json").read_text() == "{}"
    code, out = _run(["make-tiny", str(model), "--force", "--arch", "llama"])
    assert code == 0, out
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    assert (model / "draft" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.txt"]  # no staging left


# --- generate: option values --------------------------------------------------------------------
@pytest.mark.parametrize("args, option", [
    (["--verify-window", "0"], "--verify-window"),
    (["--verify-window", "wide"], "--verify-window"),
    (["--top-p", "nan"], "--top-p"),
    (["--stop", ""], "--stop"),
])
def test_generate_refuses_bad_values_as_usage_errors(tiny: Path, args: list[str], option: str) -> None:
    code, out = _run(["generate", "--model", str(tiny), "--draft", str(tiny / "draft"), "-p", "hi", *args])
    assert code == 2 and f"Invalid value for '{option}'" in out, out


def test_generate_window_beyond_the_block_is_one_line(tiny: Path) -> None:
    code, out = _run(["generate", "--model", str(tiny), "--draft", str(tiny / "draft"), "-p", "hi",
                      "--verify-window", "17"])
    assert code == 1 and out.strip() == "Error: verify window 17 is larger than this draft's block of 16 tokens"


def test_generate_system_message_is_never_dropped(tiny: Path, tmp_path: Path) -> None:
    """--system only exists inside a chat template: with --raw, or a tokenizer without one, it
    used to vanish silently."""
    code, out = _run(["generate", "--model", str(tiny), "--draft", str(tiny / "draft"), "-p", "hi",
                      "--raw", "--system", "Be brief."])
    assert code == 2 and "--raw" in out, out
    plain = tmp_path / "no-template"
    code, out = _run(["make-tiny", str(plain)])
    assert code == 0, out
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    code, out = _run(["generate", "--model", str(plain), "--draft", str(plain / "draft"), "-p", "hi",
                      "-m", "2", "--system", "Be brief."])
    assert code == 1 and "a system message goes into the chat template" in out, out
    code, out = _run(["generate", "--model", str(plain), "--draft", str(plain / "draft"), "-p", "hi",
                      "-m", "2", "--json"])
    assert code == 0 and json.loads(out)["stats"]["generated_tokens"] == 2, out


def test_compare_plain_on_a_sliding_window_target_is_refused_up_front(tmp_path: Path) -> None:
    """gemma3's rotating cache cannot run plain steps: the refusal used to come after the whole
    DFlash run, whose result was then lost (exit 1, text streamed, no stats)."""
    gemma = tmp_path / "gemma"
    code, out = _run(["make-tiny", str(gemma), "--arch", "gemma3_text"])
    assert code == 0, out
    args = ["generate", "--model", str(gemma), "--draft", str(gemma / "draft"), "-p", "hi", "-m", "6"]
    code, out = _run([*args, "--compare-plain"])
    assert code == 1 and out.startswith("Error: --compare-plain decodes plainly"), out
    code, out = _run([*args, "--json"])
    assert code == 0 and json.loads(out)["stats"]["generated_tokens"] == 6, out


# --- generate: Ctrl-C ---------------------------------------------------------------------------
def _generate(tiny: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, "generate", "--model", str(tiny), "--draft", str(tiny / "draft"), "-p", "hello",
         "-m", "100000", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **NO_REEXEC},
        preexec_fn=_sigint_default)


def _sigint_default() -> None:
    """SIGINT at its default in the child: a test run in the background ignores it, and
    children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_the_stats(tiny: Path) -> None:
    proc = _generate(tiny)
    assert proc.stdout.read1(1)  # text is streaming: decoding has begun
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    stats = next(line for line in text.splitlines() if line.startswith("[dflash] prompt"))
    assert stats.endswith("| cancelled") and text.rstrip().endswith("cancelled")


def test_ctrl_c_with_json_still_prints_the_json(tiny: Path) -> None:
    """--json streams nothing, so the signal goes after a delay; one that lands while the model
    still loads (a slow shared machine) is retried later."""
    for delay in (6, 15, 40):
        proc = _generate(tiny, "--json")
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and b"Traceback" not in err, err.decode()
        if out.strip():
            break
    data = json.loads(out)
    assert data["stats"]["finish_reason"] == "cancelled"
    assert data["stats"]["generated_tokens"] == len(data["token_ids"]) > 0


def test_an_early_ctrl_c_says_cancelled_not_a_traceback(monkeypatch, capsys) -> None:
    """A Ctrl-C while the `dflash` command is still importing MLX and mlx-lm (its first second):
    "cancelled", exit 130, no traceback (engine/launch.py, the console script's entry). The
    interrupt is delivered inside the import itself, as a real one lands there."""
    import types

    from dflash.engine import launch

    class Interrupting(types.ModuleType):
        def __getattr__(self, name: str):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "dflash.engine.cli", Interrupting("dflash.engine.cli"))
    with pytest.raises(SystemExit) as e:
        launch.main()
    assert e.value.code == 130 and capsys.readouterr().err == "cancelled\n"
    script = Path(sys.executable).parent / "dflash"  # the installed command goes through it
    assert "dflash.engine.launch" in script.read_text()
