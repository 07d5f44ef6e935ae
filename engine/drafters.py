"""Drafters: what proposes the B-1 tokens of a block. The DFlash draft, and an oracle.

The engine sees one small interface: reset() per request, add_context() with the target
features of newly committed tokens, and propose() for the block that follows an anchor.
The oracle replays known greedy ids (optionally corrupted at chosen block positions): it is
how tests pin acceptance exactly and how `dflash benchmark --oracle` measures the ceiling.
Under sampling, propose() gets `sampling` and returns (ids, q): q holds the probs the ids were
drawn from, or None for a drafter that only gives ids (verify then takes q one-hot).
"""

from __future__ import annotations

import os
from typing import Any, Protocol, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import branches, cpufast, fuse
from . import sampling as sampling_mod
from . import verifyattn
from .draft import DFlashDraft
from .draftvocab import SubsetHead
from .sampling import DraftSampling
from .sparse import PositionedKVCache
from .target import TargetModel


class Drafter(Protocol):
    block_size: int
    layer_ids: list[int]

    def reset(self, positioned: bool = False) -> None:
        """Start a request; `positioned` when the prompt is a sparse selection."""
        ...

    def jump(self, position: int) -> None:
        """Next context rows start at this true position (sparse prefill runs)."""
        ...

    def add_context(self, features: mx.array) -> None: ...

    def trim(self, rows: int) -> None:
        """Drop the last `rows` context rows (a run-ahead block not wholly accepted)."""
        ...

    def propose(
        self,
        anchor: mx.array,
        anchor_pos: int,
        count: int | None = None,
        sampling: DraftSampling | None = None,
        rows: int = 1,
    ) -> mx.array | tuple[mx.array, mx.array | None]:
        """Draft ids for positions anchor_pos+1 .. anchor_pos+count (default B-1), lazy.

        Only `count` rows go through the LM head, the draft's biggest matmul, when the verify
        window is shorter. The block runs whole (every position sees the full block) unless the
        drafter cuts short blocks (`short_max`, see DFlashDrafter).
        With `sampling`: (ids, q), the ids drawn from q (count, V), or q None (ids only).
        A drafter without the `sampling` parameter is used as an ids-only one.
        `rows` > 1 (greedy, a drafter with the parameter): ids [rows', count], several
        proposals for one batched verify (engine/branches.py); rows' may be fewer.
        A drafter with a `confidence` parameter (greedy): given True, (ids, p) with p the
        draft's own probability of each proposed id, for a window chosen after the draft
        (engine/window.py, "Windows chosen by the draft's confidence").
        """
        ...


def short_block_max(config: Any) -> int:
    """The longest window whose draft runs a block cut to the window's rows (0: never).

    A draft records it in its config (dflash_config.short_block_max: `train-draft
    --short-block-frac` writes it); it is used on a CPU only, where a pass costs its rows'
    arithmetic. On a GPU a small draft's pass costs its kernel launches, as many for 2 rows as
    for 16, so a cut block would save nothing. DFLASH_SHORT_BLOCK=N sets it anywhere (0: off).
    """
    env = os.environ.get("DFLASH_SHORT_BLOCK", "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"DFLASH_SHORT_BLOCK must be a whole number (0: off), got {env!r}")
        n = int(env)
    elif mx.default_device() == mx.gpu:
        n = 0
    else:
        n = int((config.extra.get("dflash_config") or {}).get("short_block_max", 0))
    return n if n >= 2 else 0


class DFlashDrafter:
    """The block-diffusion draft: one non-causal pass over [anchor, MASK x (B-1)].

    `vocab` (draftvocab.choose): the token ids it may propose, scored by a head restricted to
    them; None: the target's whole head.

    `short_max` (short_block_max): a window of k <= short_max tokens drafts from [anchor,
    MASK x (k-1)], a pass about half as dear on a CPU at k = 2. Lossless either way (the verify
    decides); what it changes is acceptance, which drops for a draft never trained on cut blocks
    (session 9: 62% -> 55% at window 2), hence `train-draft --short-block-frac`.
    """

    def __init__(self, draft: DFlashDraft, target: TargetModel, vocab: Sequence[int] | None = None):
        check_fit(draft, target)
        self.draft = draft
        self.target = target
        self.head = SubsetHead(target, vocab) if vocab else None
        self.block_size = draft.config.block_size
        self.layer_ids = list(draft.config.target_layer_ids)
        self._masks = mx.full((self.block_size - 1,), draft.config.mask_token_id, mx.int32)
        self.short_max = min(short_block_max(draft.config), self.block_size - 1)
        self.cache: list[KVCache] = draft.make_cache()
        cpufast.install(draft)  # its RoPEs and RMSNorms in fewer CPU kernels, same bits
        # q/k/v and gate/up as one product each (a GPU's default), and with them every layer's
        # context K/V products as one (fuse.py)
        self.context_kv = fuse.context_stack(draft) if fuse.install(draft) else None

    def reset(self, positioned: bool = False) -> None:
        if positioned:
            self.cache = [PositionedKVCache() for _ in self.draft.layers]
        else:
            self.cache = self.draft.make_cache()

    def jump(self, position: int) -> None:
        for c in self.cache:
            c.jump(position)

    @property
    def context_len(self) -> int:
        return self.cache[0].offset

    def add_context(self, features: mx.array) -> None:
        with cpufast.active(), fuse.active():
            self.draft.add_context(features.astype(self.draft.fc.weight.dtype), self.cache,
                                   self.context_kv if fuse.ON else None)

    def trim(self, rows: int) -> None:
        for c in self.cache:
            c.trim(rows)

    def propose(
        self,
        anchor: mx.array,
        anchor_pos: int,
        count: int | None = None,
        sampling: DraftSampling | None = None,
        rows: int = 1,
        confidence: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        if self.context_len != anchor_pos:
            raise RuntimeError(
                f"draft context holds {self.context_len} rows, anchor is at {anchor_pos}"
            )
        masks = self._masks if count is None or count + 1 > self.short_max else self._masks[:count]
        block = mx.concatenate([anchor.reshape(1).astype(mx.int32), masks])[None]
        # the block's 16 queries over the context: fewq's kernel on CUDA; cpufast.py on a CPU
        with verifyattn.active(), cpufast.active(), fuse.active():
            h = self.draft(self.target.embed(block), anchor_pos, self.cache)
        hidden = h[:, 1 : 1 + (self.block_size - 1 if count is None else count)]
        logits = (self.target.lm_head if self.head is None else self.head)(hidden)[0]
        if sampling is None:
            best = branches.rows_from_logits(logits, rows) if rows > 1 else mx.argmax(logits, axis=-1)
            ids = (best if self.head is None else self.head.token_ids(best)).astype(mx.int32)
            if not confidence:
                return ids
            # the softmax at the argmax, 1 / sum(exp(logits - max)): calibrated on held-out text
            # (session 19: drafts at p 0.9+ accepted 98% of the time, at 0.5 65%)
            top = mx.max(logits, axis=-1, keepdims=True).astype(mx.float32)
            return ids, 1.0 / mx.sum(mx.exp(logits.astype(mx.float32) - top), axis=-1)
        if self.head is not None:
            logits = self.head.full(logits)  # q is zero outside the subset
        q = sampling_mod.probs(logits, sampling.params)
        return sampling_mod.draw(q, sampling.key), q

    @property
    def proposal_vocab(self) -> int | None:
        """How many tokens the draft may propose (None: the target's whole vocabulary)."""
        return None if self.head is None else self.head.size


class OracleDrafter:
    """Proposes the reference continuation (the target's own greedy ids), for tests/ceilings.

    Under sampling it is an ids-only drafter (q one-hot): the reference is accepted with the
    target's probability of each token, and the output is still exactly the target's sampler.
    """

    def __init__(
        self,
        reference: Sequence[int],
        prompt_len: int,
        block_size: int = 16,
        layer_ids: Sequence[int] = (0,),
        corrupt_at: Sequence[int] = (),
        vocab_size: int = 2,
    ):
        self.reference = list(reference)
        self.prompt_len = prompt_len
        self.block_size = block_size
        self.layer_ids = list(layer_ids)
        self.corrupt_at = set(corrupt_at)
        self.vocab_size = vocab_size

    def reset(self, positioned: bool = False) -> None:
        pass

    def jump(self, position: int) -> None:
        pass

    def add_context(self, features: mx.array) -> None:
        pass

    def trim(self, rows: int) -> None:
        pass

    def propose(
        self,
        anchor: mx.array,
        anchor_pos: int,
        count: int | None = None,
        sampling: DraftSampling | None = None,
    ) -> mx.array | tuple[mx.array, None]:
        start = anchor_pos + 1 - self.prompt_len
        ids = []
        for j in range(1, 1 + (self.block_size - 1 if count is None else count)):
            i = start + j - 1
            tok = self.reference[i] if 0 <= i < len(self.reference) else 0
            if j in self.corrupt_at:
                tok = (tok + 1) % self.vocab_size
            ids.append(tok)
        drafts = mx.array(ids, dtype=mx.int32)
        return drafts if sampling is None else (drafts, None)


def check_fit(draft: DFlashDraft, target: TargetModel) -> None:
    """Refuse a draft that cannot work with this target, with the reason."""
    cfg = draft.config
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.vocab_size and cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for {target.num_layers} layers")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target's vocabulary")
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size} < 2")
    if problems:
        raise ValueError("draft does not fit the target: " + "; ".join(problems))
