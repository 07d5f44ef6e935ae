"""Session 42: damaged or inconsistent inputs to `dflash import` and to model / draft loading are
one line naming the file and what is wrong; a refused import leaves nothing behind.

The GGUF files here are real ones, small: written with gguf-py's GGUFWriter (a 2-layer llama with
a byte-level vocabulary), then imported through the `dflash import` command.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason="gguf not installed (pip install 'dflash[import]')"
)

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2


def _byte_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (printable bytes as themselves, the rest shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shift = 0
    out = {}
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shift)
            shift += 1
    return [out[b] for b in range(256)]


def write_gguf(path: Path, meta: dict | None = None, tensors: dict | None = None, drop: tuple = ()) -> Path:
    """A small llama GGUF at `path`; `meta` overrides header fields (name -> value), `tensors`
    replaces tensors (ggml name -> numpy array, in numpy's row-major shape), `drop` leaves some out."""
    import gguf

    rng = np.random.default_rng(0)
    tokens = _byte_tokens() + ["ab", "<|im_end|>"]
    vocab = len(tokens)
    fields = {
        "llama.block_count": LAYERS, "llama.context_length": 256, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": HIDDEN // HEADS,
        "tokenizer.ggml.bos_token_id": vocab - 1, "tokenizer.ggml.eos_token_id": vocab - 1,
    }
    fields.update(meta or {})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * (vocab - 1) + [3])
    w.add_array("tokenizer.ggml.merges", ["a b"])

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    arrays = {"token_embd.weight": rand(vocab, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    kv = KV_HEADS * (HIDDEN // HEADS)
    for i in range(LAYERS):
        arrays.update({
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": rand(HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": rand(kv, HIDDEN),
            f"blk.{i}.attn_v.weight": rand(kv, HIDDEN), f"blk.{i}.attn_output.weight": rand(HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": rand(FFN, HIDDEN), f"blk.{i}.ffn_up.weight": rand(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": rand(HIDDEN, FFN),
        })
    arrays.update(tensors or {})
    for name, a in arrays.items():
        if name not in drop:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dflash(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`dflash ARGS` as a user runs it, in `cwd`."""
    return subprocess.run([sys.executable, "-m", "dflash.engine.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _one_line_error(out: subprocess.CompletedProcess, code: int = 1) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


@needs_gguf
def test_the_small_gguf_imports_and_loads(tmp_path):
    """The writer above makes a file the importer takes: the cases below fail for their damage."""
    src = write_gguf(tmp_path / "ok.gguf")
    out = _dflash(tmp_path, "import", str(src), "--out", "model")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "model" / "config.json").read_text())["num_hidden_layers"] == LAYERS


@needs_gguf
@pytest.mark.parametrize("case,says", [
    # Before: the import succeeded and wrote a folder mlx-lm could not load (missing / extra layers,
    # shapes the config does not give).
    (dict(meta={"llama.block_count": LAYERS + 1}), "its metadata does not match its tensors (Missing"),
    (dict(meta={"llama.block_count": LAYERS - 1}), "its metadata does not match its tensors (Received"),
    (dict(meta={"llama.feed_forward_length": FFN // 2}), "Expected shape (64, 64) but received shape (128, 64)"),
    (dict(drop=("blk.1.ffn_down.weight",)), "Missing 1 parameters: model.layers.1.mlp.down_proj.weight"),
    # Before: tracebacks (ZeroDivisionError; NotImplementedError from gguf-py's dequantize).
    (dict(meta={"llama.attention.head_count": 0}), "llama.attention.head_count is 0, not a whole number >= 1"),
    (dict(tensors={"blk.0.attn_norm.weight": np.ones(HIDDEN, np.int32)}),
     "tensor blk.0.attn_norm.weight is stored as I32, which the converter cannot read"),
    # Before: a bare numpy reshape error naming no tensor.
    (dict(meta={"llama.attention.head_count": 3}), "tensor blk.0.attn_q.weight (shape [64, 64]) does not fit"),
    # Before: imported silently; the model computed NaN.
    (dict(tensors={"blk.1.ffn_up.weight": np.full((FFN, HIDDEN), np.nan, np.float32)}),
     "tensor blk.1.ffn_up.weight holds NaN or infinite values"),
])
def test_a_damaged_gguf_is_refused_in_one_line_and_nothing_is_written(tmp_path, case, says):
    src = write_gguf(tmp_path / "bad.gguf", **case)
    out = _dflash(tmp_path, "import", str(src), "--out", "new/model")
    line = _one_line_error(out)
    assert says in line and "bad.gguf" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


@needs_gguf
def test_a_special_token_id_outside_the_vocabulary_is_dropped(tmp_path):
    """Before: config.json carried eos_token_id 1000000 (an EOS never met; llama.cpp drops it)."""
    src = write_gguf(tmp_path / "ok.gguf", meta={"tokenizer.ggml.eos_token_id": 10**6,
                                                 "tokenizer.ggml.bos_token_id": 10**6})
    out = _dflash(tmp_path, "import", str(src), "--out", "model")
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["eos_token_id"] == 257 and config["bos_token_id"] is None  # <|im_end|> by its name


@needs_gguf
def test_a_tokenizer_that_cannot_be_written_is_an_oserror(tmp_path):
    """Before: tokenizers' save() raised a bare Exception (a traceback from `dflash import` on a
    disk that filled up after the weights were written)."""
    from dflash.engine.convert import build_tokenizer_files, open_gguf, read_metadata

    meta = read_metadata(open_gguf(write_gguf(tmp_path / "ok.gguf")))
    with pytest.raises(OSError):
        build_tokenizer_files(meta, tmp_path / "gone")
    build_tokenizer_files(meta, tmp_path)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("ab").ids == [256]


@needs_gguf
def test_weights_float16_cannot_hold_are_refused_in_float16_only(tmp_path):
    """Before: `--dtype float16` wrote them as inf, a model that computes NaN."""
    big = np.ones(HIDDEN, np.float32)
    big[3] = 1e5
    src = write_gguf(tmp_path / "big.gguf", tensors={"output_norm.weight": big})
    out = _dflash(tmp_path, "import", str(src), "--out", "m16", "--dtype", "float16")
    assert "output_norm.weight holds values beyond float16's range" in _one_line_error(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.gguf"]
    out = _dflash(tmp_path, "import", str(src), "--out", "mbf16", "--dtype", "bfloat16")
    assert out.returncode == 0, out.stderr


@needs_gguf
def test_force_never_replaces_the_folder_holding_the_source(tmp_path):
    """Before: `--force` replaced the folder, deleting the GGUF it had just read."""
    folder = tmp_path / "models" / "x"
    folder.mkdir(parents=True)
    src = write_gguf(folder / "x.gguf")
    before = src.read_bytes()
    out = _dflash(tmp_path, "import", str(src), "--out", "models/x", "--force")
    assert "holds the GGUF being imported" in _one_line_error(out)
    assert sorted(p.name for p in folder.iterdir()) == ["x.gguf"] and src.read_bytes() == before


@needs_gguf
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """Before: a RuntimeError traceback from MLX's writer. RLIMIT_FSIZE stands in for a full disk
    (Python ignores SIGXFSZ, so the write fails as on ENOSPC/EFBIG)."""
    src = write_gguf(tmp_path / "ok.gguf")
    limit = 64  # KiB blocks: far below the fp32 weights (~ 600 KiB)
    cmd = f"ulimit -f {limit}; exec '{sys.executable}' -m dflash.engine.cli import ok.gguf --out model"
    out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "is the disk full?" in _one_line_error(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.gguf"]


# --- a damaged or mismatched model folder and draft, as `dflash generate` loads them -------------
def _edit_json(path: Path, change) -> None:
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def _split_in_two_shards_and_lose_one(d: Path) -> None:
    import mlx.core as mx

    weights = mx.load(str(d / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        mx.save_safetensors(str(d / file), {k: weights[k] for k in keys})
    index = {"weight_map": {k: file for file, keys in halves.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model.safetensors").unlink()
    (d / "model-00002-of-00002.safetensors").unlink()


@pytest.mark.parametrize("damage,says", [
    # Before: a RuntimeError / KeyError / TypeError / AttributeError traceback from mlx-lm.
    (lambda d: _cut(d / "model.safetensors"), "cannot be loaded: [load_safetensors] The JSON header"),
    (lambda d: _edit_json(d / "config.json", lambda c: c.pop("model_type")), "config.json lacks 'model_type'"),
    (lambda d: _edit_json(d / "config.json", lambda c: c.pop("hidden_size")), "missing 1 required positional"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json is not a model config"),
    # Before: "Expecting value: line 1 column 14 (char 13)", naming no file.
    (lambda d: (d / "config.json").write_text('{"model_type": '), "config.json is not readable JSON"),
    # Before: transformers made an empty tokenizer; the error was "empty prompt".
    (lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")],
     "has no tokenizer"),
    # Before: "Missing 23 parameters: model.layers.2.input_layernorm.weight, ..." (a long list).
    (_split_in_two_shards_and_lose_one,
     "lacks 1 of the 2 weight files its model.safetensors.index.json lists (model-00002-of-00002.safetensors)"),
])
def test_a_damaged_model_folder_is_named_in_one_line(tiny_dirs, tmp_path, damage, says):
    from dflash.engine.loading import load_pair

    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["qwen3"], model)
    damage(model)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        load_pair(model)
    assert says in str(e.value) and str(model) in str(e.value), str(e.value)


def test_a_gguf_given_as_the_model_points_at_import(tmp_path):
    from dflash.engine.loading import ModelNotFoundError, resolve_model

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    """Before: "... is a file, not a model directory", with no word of how to make one."""
    with pytest.raises(ModelNotFoundError, match=r"not a model directory; `dflash import .*m\.gguf --out DIR`"):
        resolve_model(tmp_path / "m.gguf")


def _draft_cases():
    def ids(value):
        return lambda d: _edit_json(d / "config.json", lambda c: c["dflash_config"].update(target_layer_ids=value))

    def dangling(d):
        (d / "model.safetensors").unlink()
        (d / "model.safetensors").symlink_to(d / "blobs" / "gone")  # a cache blob removed

    return [
        # Before: RuntimeError tracebacks from MLX's loader.
        (lambda d: _cut(d / "model.safetensors"), "damaged draft files ([load_safetensors]"),
        (dangling, "damaged draft files ([load_safetensors] Failed to open file"),
        # Before: KeyError / AttributeError / TypeError tracebacks.
        (lambda d: _edit_json(d / "config.json", lambda c: c.pop("num_attention_heads")),
         "draft config.json lacks 'num_attention_heads'"),
        (lambda d: (d / "config.json").write_text("[]"), "not a DFlash draft"),
        (ids(["0", 2, 3]), "target_layer_ids must be a list of layer numbers >= 0, got ['0', 2, 3]"),
        (ids(3), "target_layer_ids must be a list of layer numbers >= 0, got 3"),
        # Before: "capture layer ids [-1] are out of range" (negative ids read from the end).
        (ids([-1, 2, 3]), "target_layer_ids must be a list of layer numbers >= 0"),
        # Before: a weight-shape error naming neither the draft nor its config.
        (lambda d: _edit_json(d / "config.json", lambda c: c.update(hidden_size=32)),
         "the draft's weights do not match its config.json (Expected shape"),
        (lambda d: (d / "config.json").write_text("{"), "config.json is not readable JSON"),
    ]


@pytest.mark.parametrize("damage,says", _draft_cases())
def test_a_damaged_draft_is_named_in_one_line(tiny_dirs, tmp_path, damage, says):
    from dflash.engine.loading import load_pair

    draft = tmp_path / "draft"
    shutil.copytree(tiny_dirs["qwen3"] / "draft", draft)
    damage(draft)
    with pytest.raises(ValueError) as e:
        load_pair(tiny_dirs["qwen3"], draft)
    assert says in str(e.value) and str(draft) in str(e.value), str(e.value)


def test_a_draft_and_a_target_swapped_are_named(tiny_dirs, tmp_path):
    """Before: a draft as --model read "no DFlash draft is known for ...", or (with --draft) a
    list of 14 parameters "not in model"."""
    target = tiny_dirs["qwen3"]
    out = _dflash(tmp_path, "generate", "--model", str(target / "draft"), "--draft", str(target / "draft"),
                  "-p", "Hi", "-m", "2")
    assert "is a DFlash draft, not a target model: pass it as --draft" in _one_line_error(out)
    out = _dflash(tmp_path, "generate", "--model", str(target), "--draft", str(tiny_dirs["llama"]),
                  "-p", "Hi", "-m", "2")
    assert f"{tiny_dirs['llama']}: not a DFlash draft" in _one_line_error(out)


@needs_gguf
def test_an_out_link_to_nowhere_is_refused_before_converting(tmp_path):
    """Before: the whole conversion ran, then "[Errno 20] Not a directory: '.../.out.importing-...'"."""
    src = write_gguf(tmp_path / "ok.gguf")
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    out = _dflash(tmp_path, "import", str(src), "--out", "out")
    assert f"--out out is a link to {tmp_path / 'gone'}, which does not exist" in _one_line_error(out)
    assert "reading" not in out.stderr  # refused before the GGUF was opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.gguf", "out"]


@needs_gguf
def test_a_killed_imports_staging_folder_is_cleared_by_the_next(tmp_path):
    """Before: each import killed by SIGKILL (or the OOM killer) left `.model.importing-*`, up to
    the whole model, hidden beside --out; reruns never removed it. A live import's is kept."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".model.importing-{gone.pid}-0badf00d"
    live = tmp_path / f".model.importing-{os.getpid()}-600dcafe"
    other = tmp_path / f".model2.importing-{gone.pid}-0badf00d"  # another --out's: not ours to clear
    for d in (stale, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 4096)
    src = write_gguf(tmp_path / "ok.gguf")
    out = _dflash(tmp_path, "import", str(src), "--out", "model")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ok.gguf", "model", live.name, other.name])


@pytest.mark.parametrize("tool", ["train-draft", "eval-draft", "benchmark"])
def test_the_long_tools_name_a_damaged_target_in_one_line(tiny_dirs, tmp_path, tool):
    """train-draft, eval-draft and benchmark loaded the target through mlx-lm themselves: weights
    cut short were a RuntimeError traceback there. They load it as load_pair does now."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["qwen3"], model)
    _cut(model / "model.safetensors")
    args = {"train-draft": ["--target", str(model), "--out", str(tmp_path / "run"), "--max-steps", "1"],
            "eval-draft": ["--target", str(model), "--draft", str(tiny_dirs["qwen3"] / "draft")],
            "benchmark": ["--model", str(model), "--draft", str(tiny_dirs["qwen3"] / "draft"), "--max-tokens", "4",
                          "--contexts", "64", "--repeats", "1", "--out", str(tmp_path / "bench")]}[tool]
    out = _dflash(tmp_path, tool, *args)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "cannot be loaded" in out.stderr and str(model) in out.stderr, out.stderr
