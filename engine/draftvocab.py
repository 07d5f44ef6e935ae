"""The draft's proposal vocabulary: only the target's most frequent answer tokens.

The draft borrows the target's LM head. Over SmolLM2's 49,152 tokens that product is a third
of a CPU draft pass or more (2-core Xeon, fp32 + MKL: 15 rows 8-20 ms of a 25-35 ms pass, the
block's five layers ~14 ms), while the 16,384 most frequent tokens of the target's own answers
cover 98.97% of the tokens of greedy answers it was not counted on (data-s11, 5% held back).
A draft that scores only the top N of a frequency ranking (the idea of FR-Spec, Zhao et al.
2025) proposes the same tokens except rare ones, for a third of the head's cost. The verify
still runs the target's full head, so the output never changes: a token outside the subset is
simply never drafted, and a cycle that needed it stops there (greedy), or the draft's q is zero
there (sampling: the residual gives the target's own probability back; still exact).

A draft directory may hold `draft_vocab.json`: {"ranked": [token ids, most frequent first],
"default_size": N, "source": ..., "tokens_counted": ...}; `dflash draft-vocab` writes it from a
training data cache. DFLASH_DRAFT_VOCAB picks the size: a number, or `0` / `full` for the whole
vocabulary; unset, the file's default on the CPU and the whole vocabulary on a GPU (where the
head costs little and every drafted token counts).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import rowpad

FILE = "draft_vocab.json"
ENV = "DFLASH_DRAFT_VOCAB"
DEFAULT_SIZE = 16384  # what `dflash draft-vocab` and train-draft write as a new ranking's default


def describe(size: int) -> str:
    """How status lines and logs name a restricted proposal vocabulary of `size` tokens."""
    return f"its {size} most frequent tokens"


def rank(responses: Iterable[Sequence[int]]) -> tuple[list[int], int]:
    """(token ids by falling frequency, ties by id; how many tokens were counted)."""
    counts: Counter[int] = Counter()
    for ids in responses:
        counts.update(int(t) for t in ids)
    return sorted(counts, key=lambda t: (-counts[t], t)), sum(counts.values())


def write(draft_dir: str | Path, ranked: Sequence[int], default_size: int, source: str,
          tokens_counted: int) -> Path:
    """Write draft_vocab.json into the draft directory (atomically); returns its path."""
    if not ranked:
        raise ValueError("no tokens to rank: the data holds no responses")
    if default_size < 0:
        raise ValueError(f"default size must be >= 0 (0: the whole vocabulary), got {default_size}")
    path = Path(draft_dir) / FILE
    body = {"default_size": int(default_size), "source": source,
            "tokens_counted": int(tokens_counted), "ranked": [int(t) for t in ranked]}
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(body, separators=(",", ":")) + "\n")
        tmp.replace(path)
    except BaseException:  # a full disk or Ctrl-C: no torn draft_vocab.tmp left in the draft
        tmp.unlink(missing_ok=True)
        raise
    return path


def read(draft_dir: str | Path) -> dict[str, Any] | None:
    """The draft's vocabulary file, checked; None when the draft has none."""
    path = Path(draft_dir) / FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        ranked, size = body["ranked"], body["default_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a draft vocabulary file ({e})") from None
    if not isinstance(ranked, list) or not all(isinstance(t, int) and t >= 0 for t in ranked):
        raise ValueError(f"{path}: 'ranked' must be a list of token ids")
    if len(set(ranked)) != len(ranked):
        raise ValueError(f"{path}: 'ranked' repeats token ids")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{path}: 'default_size' must be an integer >= 0")
    return body


def requested_size(default: int) -> int:
    """The size DFLASH_DRAFT_VOCAB asks for (0: the whole vocabulary), else `default`."""
    env = os.environ.get(ENV, "").strip().lower()
    if not env:
        return default
    if env in ("0", "full"):
        return 0
    try:
        n = int(env)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV} must be a token count, 0 or 'full'; got {env!r}")
    return n


def choose(draft_dir: str | Path | None, vocab_size: int) -> list[int] | None:
    """The token ids the draft may propose (sorted), or None for the whole vocabulary."""
    body = read(draft_dir) if draft_dir is not None else None
    default = body["default_size"] if body and mx.default_device() == mx.cpu else 0
    n = requested_size(default)
    if n == 0:
        return None
    if body is None:
        raise ValueError(f"{ENV}={n} needs a ranking: the draft {draft_dir} has no {FILE} "
                         "(write one with `dflash draft-vocab`)")
    if n >= vocab_size:
        return None
    return sorted([t for t in body["ranked"] if t < vocab_size][:n])


class SubsetHead:
    """The target's LM head restricted to `ids`: logits over the subset, and the way back."""

    def __init__(self, target: Any, ids: Sequence[int]):
        if not ids:
            raise ValueError("a draft vocabulary needs at least one token")
        self.target = target
        self.size = len(ids)
        self.ids = mx.array(list(ids), dtype=mx.int32)
        src = target.head_module
        weight = src.weight[self.ids]
        if "scales" in src:  # quantized rows: dequantize the kept ones once (V/N times fewer)
            weight = mx.dequantize(weight, src.scales[self.ids],
                                   src.biases[self.ids] if "biases" in src else None,
                                   src.group_size, src.bits, mode=getattr(src, "mode", "affine"))
        self.proj = nn.Linear(weight.shape[1], self.size, bias="bias" in src)
        self.proj.weight = weight
        if "bias" in src:
            self.proj.bias = src.bias[self.ids]
        mx.eval(self.proj.parameters())
        rowpad.pad_rows(self.proj, rowpad.plan(self.proj))  # the same few-row rule as the head

    def __call__(self, h: mx.array) -> mx.array:
        """Logits [.., N] over the subset, with the target's soft-capping if it has one."""
        with rowpad.active():
            return self.target.cap_logits(self.proj(h))

    def token_ids(self, index: mx.array) -> mx.array:
        """Vocabulary ids of subset positions."""
        return self.ids[index]

    def full(self, logits: mx.array) -> mx.array:
        """Subset logits [R, N] -> [R, V] with -inf outside the subset (zero probability)."""
        out = mx.full((logits.shape[0], self.target.vocab_size), -mx.inf, dtype=logits.dtype)
        idx = mx.broadcast_to(self.ids[None], logits.shape)
        return mx.put_along_axis(out, idx, logits, axis=-1)
