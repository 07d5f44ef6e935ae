"""Loading a target/draft pair: mlx-lm for the target, our format for the draft."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import accel, draftvocab
from .draft import load_draft
from .drafters import DFlashDrafter
from .registry import hf_cache_dir, resolve_draft
from .target import TargetModel

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def floating_dtypes(model: Any) -> tuple[Counter, bool]:
    """Parameter counts per floating dtype name, and whether the model holds quantized packs."""
    from mlx.utils import tree_flatten

    sizes: Counter = Counter()
    packed = False
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            sizes[str(p.dtype).replace("mlx.core.", "")] += p.size
        packed = packed or p.dtype == mx.uint32
    return sizes, packed


def main_dtype(model: Any) -> str | None:
    """The name of the floating dtype holding most of `model`'s weights (None: none)."""
    sizes, _ = floating_dtypes(model)
    return sizes.most_common(1)[0][0] if sizes else None


def draft_dtype(target_model: Any, dtype: str | None) -> mx.Dtype | None:
    """The dtype the draft computes in: `dtype` when given; else float32 when the target's
    weights are float32, and the draft's stored dtype (None) otherwise.

    Drafts ship in bf16 (half the size). Beside a float32 target the draft computes in float32
    too, so `dflash benchmark`, `eval-draft` and the daemon run a pair the same way whether or not
    `--dtype float32` is given (`make demo` gives it). Measured on the 2-core VM (session 12,
    bundled draft): held-out 62.1% / tau 2.59 in float32 against 62.0% / 2.59 in bf16, and the
    same speed (a 16-token draft pass 27-32 ms either way, interleaved runs; a first probe that
    had bf16 twice as slow did not reproduce).
    """
    if dtype is not None:
        return DTYPES[dtype]
    return mx.float32 if main_dtype(target_model) == "float32" else None


class ModelNotFoundError(FileNotFoundError):
    """The target model is not a local model directory (dflash never downloads one)."""


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str | Path) -> str:
    """The local directory of `model`: a path, or a Hugging Face repo id already in the local
    cache. Checked before anything loads, because mlx-lm would otherwise take a missing path for
    a repo id and try the network, and a user would read a draft or hub error for a typo."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{model} is not a model directory (it has no config.json); "
                                     "`dflash import` makes one")
        _check_config(path, model)
        return str(path)
    if path.exists():
        hint = f"; `dflash import {model} --out DIR` makes one from it" if path.suffix.lower() == ".gguf" else ""
        raise ModelNotFoundError(f"{model} is a file, not a model directory{hint}")
    text = str(model)
    if _REPO_ID.fullmatch(text):
        snap = hf_cache_dir(text)
        if snap is not None:
            _check_config(snap, model)
            return str(snap)
        raise ModelNotFoundError(f"model {text} not found: no such directory, and no such repo in the "
                                 "local Hugging Face cache (dflash never downloads)")
    raise ModelNotFoundError(f"model directory not found: {text}")


def _check_config(path: Path, model: str | Path) -> None:
    """Refuse a config.json mlx-lm would crash on (cut short, not a JSON object) and a DFlash
    draft given as the target, naming the file."""
    cfg_file = path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelNotFoundError(f"{cfg_file} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelNotFoundError(f"{cfg_file} is not a model config (a JSON object)")
    if "dflash_config" in cfg:
        raise ModelNotFoundError(f"{model} is a DFlash draft, not a target model: pass it as --draft "
                                 "and its target as --model")


def _missing_shards(path: Path) -> str | None:
    """Which weight files the folder's index lists and it lacks (a copy or download cut short),
    said as a reason; None when it lacks none or has no index."""
    try:
        shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    missing = sorted(str(f) for f in shards if not (path / str(f)).is_file())
    if not missing:
        return None
    return (f"it lacks {len(missing)} of the {len(shards)} weight files its model.safetensors.index.json "
            f"lists ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): copy or download them again")


def load_target(local: str, model: str | Path) -> tuple[Any, Any]:
    """mlx-lm's (model, tokenizer) from the local folder `local` (resolve_model), with a damaged
    or incomplete folder said in one line naming it: MLX raises a bare RuntimeError for weights
    cut short, mlx-lm a KeyError or TypeError for a config missing a field."""
    from mlx_lm import load as mlx_load

    from ..daemon.protocol import reason_line

    try:
        model_obj, tokenizer = mlx_load(local)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        reason = reason_line(f"config.json lacks {e}" if isinstance(e, KeyError) else e) or type(e).__name__
        reason = _missing_shards(Path(local)) or reason  # "Missing N parameters" says less
        raise ValueError(f"model {model} cannot be loaded: {reason}") from None
    size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int) and size < 2:  # transformers builds an empty tokenizer from nothing
        raise ValueError(f"model {model} has no tokenizer (tokenizer.json or tokenizer.model); "
                         "copy its tokenizer files into the folder")
    return model_obj, tokenizer


@dataclass
class Pair:
    """A loaded target, its drafter and tokenizer, ready for stream_dflash_generate."""

    target: TargetModel
    drafter: DFlashDrafter
    tokenizer: Any
    model_path: str
    draft_path: str


def load_pair(
    model: str | Path,
    draft: str | Path | None = None,
    dtype: str | None = None,
    draft_quant_bits: int | None = None,
) -> Pair:
    """Load target + draft; with no draft given, resolve it from the registry of known pairs."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    local = resolve_model(model)
    draft_path = Path(draft) if draft else resolve_draft(str(model), model_dir=local)
    model_obj, tokenizer = load_target(local, model)
    if dtype is not None:
        model_obj.set_dtype(DTYPES[dtype])
    sizes, _ = floating_dtypes(model_obj)
    # a library user's process is not re-executed with MKL as the commands are: say so, once
    accel.warn_slow_blas(sizes.most_common(1)[0][0] if sizes else None, sum(sizes.values()),
                         mx.default_device() == mx.cpu)
    draft_model = load_draft(draft_path, draft_dtype(model_obj, dtype))
    target = TargetModel(model_obj, draft_model.config.target_layer_ids)
    drafter = make_drafter(target, draft_model, draft_path, draft_quant_bits)
    return Pair(target, drafter, tokenizer, str(model), str(draft_path))


def load_drafter(target: TargetModel, draft: str | Path, dtype: str | None = None) -> DFlashDrafter:
    """A second draft for an already loaded target (an A/B of drafts in one process); it must
    read the target layers the target captures."""
    draft_model = load_draft(Path(draft), draft_dtype(target.model, dtype))
    if list(draft_model.config.target_layer_ids) != target.layer_ids:
        raise ValueError(f"draft {draft} reads target layers {draft_model.config.target_layer_ids}, "
                         f"the loaded target captures {target.layer_ids}")
    return make_drafter(target, draft_model, Path(draft))


def make_drafter(target: TargetModel, draft_model: Any, draft_path: Path,
                 quant_bits: int | None = None) -> DFlashDrafter:
    """The drafter of a loaded draft: quantized if asked, proposing the vocabulary it may here."""
    if quant_bits:
        from .draft import quantize_draft

        quantize_draft(draft_model, bits=quant_bits)
    return DFlashDrafter(draft_model, target, draftvocab.choose(draft_path, target.vocab_size))
