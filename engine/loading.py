"""Loading a target/draft pair: mlx-lm for the target, our format for the draft."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import draftvocab
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
        return str(path)
    if path.exists():
        raise ModelNotFoundError(f"{model} is a file, not a model directory")
    text = str(model)
    if _REPO_ID.fullmatch(text):
        snap = hf_cache_dir(text)
        if snap is not None:
            return str(snap)
        raise ModelNotFoundError(f"model {text} not found: no such directory, and no such repo in the "
                                 "local Hugging Face cache (dflash never downloads)")
    raise ModelNotFoundError(f"model directory not found: {text}")


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
    from mlx_lm import load as mlx_load

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    local = resolve_model(model)
    draft_path = Path(draft) if draft else resolve_draft(str(model), model_dir=local)
    model_obj, tokenizer = mlx_load(local)
    if dtype is not None:
        model_obj.set_dtype(DTYPES[dtype])
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
