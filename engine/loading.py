"""Loading a target/draft pair: mlx-lm for the target, our format for the draft."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .draft import load_draft
from .drafters import DFlashDrafter
from .registry import resolve_draft
from .target import TargetModel

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


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

    from .draft import quantize_draft

    draft_path = Path(draft) if draft else resolve_draft(str(model))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model_obj, tokenizer = mlx_load(str(model))
    if dtype is not None:
        model_obj.set_dtype(DTYPES[dtype])
    draft_model = load_draft(draft_path, DTYPES[dtype] if dtype else None)
    if draft_quant_bits:
        quantize_draft(draft_model, bits=draft_quant_bits)
    target = TargetModel(model_obj, draft_model.config.target_layer_ids)
    return Pair(target, DFlashDrafter(draft_model, target), tokenizer, str(model), str(draft_path))
