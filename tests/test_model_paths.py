"""A model named wrongly gets an error about the model, never a draft or hub error; the bundled
draft is found for the default target in a folder of any name; Ctrl-C in `dflash generate`
exits as a shell expects. Real files, a real tiny model and a real `dflash generate` process."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash.engine import registry
from dflash.engine.cli import main
from dflash.engine.loading import ModelNotFoundError, resolve_model

BUNDLED = registry.resolve_draft("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("name, message", [
    ("nope-dir/inner/x", "model directory not found: nope-dir/inner/x"),
    ("models/SmolLM3", "no such repo in the local Hugging Face cache"),  # a typo of a local folder
    ("someone/Qwen3-8B-4bit", "dflash never downloads"),
])
def test_a_missing_model_says_so(name, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_model(name)


def test_a_file_or_a_folder_without_config_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="is a file, not a model directory"):
        resolve_model(tmp_path / "notes.txt")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)


def test_a_repo_id_in_the_local_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--someone--Tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert resolve_model("someone/Tiny") == str(snap)
    # the draft is then found by the name as typed, not by the snapshot's folder
    model = tmp_path / "hub" / "models--mlx-community--Qwen3-8B-4bit" / "snapshots" / "def"
    draft = tmp_path / "hub" / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots" / "ghi"
    for d in (model, draft):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    local = resolve_model("mlx-community/Qwen3-8B-4bit")
    assert registry.resolve_draft("mlx-community/Qwen3-8B-4bit", model_dir=local) == draft


def test_generate_names_the_missing_model_in_one_line(tmp_path):
    # DFLASH_BLAS=none: in this process, never the re-exec that preloads a BLAS (accel.py)
    for args in (["--model", str(tmp_path / "nope")],
                 ["--model", str(tmp_path / "nope"), "--draft", str(BUNDLED)]):
        r = CliRunner(env={"DFLASH_BLAS": "none"}).invoke(main, ["generate", *args, "-p", "hi", "-m", "4"])
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert f"model directory not found: {tmp_path / 'nope'}" in r.output
        assert "draft" not in r.output.lower() and "hub" not in r.output.lower(), r.output


def test_the_bundled_draft_is_found_for_its_target_under_any_folder_name(tmp_path):
    target = json.loads((BUNDLED / "config.json").read_text())
    (tmp_path / "my-model").mkdir()
    config = {"model_type": "llama", "hidden_size": target["hidden_size"],
              "vocab_size": target["vocab_size"], "num_hidden_layers": target["num_target_layers"]}
    (tmp_path / "my-model" / "config.json").write_text(json.dumps(config))
    assert registry.resolve_draft(str(tmp_path / "my-model")) == BUNDLED
    # another shape: no draft, and the error says how drafts are found
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    with pytest.raises(registry.DraftNotFoundError, match="folder's name"):
        registry.resolve_draft(str(tmp_path / "other"))


def test_a_draft_inside_the_model_folder_is_found_without_draft(tiny_dirs, tmp_path):
    # `dflash make-tiny DIR` writes DIR/draft: `generate --model DIR` alone must find it
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dirs["qwen3"], model)
    assert registry.resolve_draft(str(model)) == model / "draft"
    r = CliRunner(env={"DFLASH_BLAS": "none"}).invoke(
        main, ["generate", "--model", str(model), "--raw", "-p", "Once upon a time", "-m", "6"])
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output or "tokens" in r.output, r.output


def test_ctrl_c_in_generate_exits_130_and_says_cancelled(tiny_dirs, tmp_path):
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dirs["qwen3"], model)
    cmd = [sys.executable, "-m", "dflash.engine.cli", "generate", "--model", str(model),
           "--draft", str(model / "draft"), "--raw", "-p", "Once upon a time", "-m", "4000"]
    # SIGINT at its default in the child (a background test run ignores it, and children inherit that)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.read(1)  # streaming has begun
        assert proc.poll() is None, (first, proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        err = proc.stderr.read()
        assert code == 130, (code, err[-500:])
        assert b"cancelled" in err and b"Traceback" not in err and b"Aborted" not in err, err[-500:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_system_message_is_refused_where_it_would_vanish(pairs):
    """build_prompt (every path: the CLI, the daemon, the library): a system message with raw
    text has nowhere to go, so it is refused, not dropped."""
    from dflash.engine.prompting import build_prompt

    tok = pairs("qwen3").tokenizer
    with pytest.raises(ValueError, match="raw text leaves out"):
        build_prompt(tok, "hello", system="Be brief.", raw=True)
    assert build_prompt(tok, "hello", raw=True) == list(tok.encode("hello"))
