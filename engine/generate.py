"""The DFlash decoding loop: prefill with capture, then draft -> verify -> accept -> rewind.

`stream_dflash_generate` yields `TokenDelta`s and ends with one `Finished` carrying the stats.
Every emitted token is the target's own greedy argmax; the draft only decides how many of them
one target pass produces. The next cycle is queued (async) before the current tokens are handed
out, so the device works while the caller consumes text. An in-flight cycle that turns out not to
be needed (stop, cancel, caller closed the generator) is rewound in `finally`, which leaves the
caches exactly at the committed tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from . import rollback
from .drafters import Drafter
from .target import TargetModel
from .verify import Verified, verify


@dataclass
class TokenDelta:
    """New tokens from one cycle, with their text and whether each came from the draft."""

    token_ids: list[int]
    text: str
    from_draft: list[bool]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    accepted_drafts: int = 0
    acceptance: float = 0.0  # accepted drafts / generated tokens
    tokens_per_cycle: float = 0.0
    block_size: int = 0
    accept_histogram: list[int] = field(default_factory=list)  # cycles by accepted count 0..B-1
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total_s: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Finished:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def stream_dflash_generate(
    target: TargetModel,
    drafter: Drafter,
    tokenizer: Any,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    *,
    stop: Sequence[str] = (),
    prefill_chunk: int = 512,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    prompt_tokens_override: Sequence[int] | None = None,
    prompt_token_positions: Sequence[int] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> Iterator[TokenDelta | Finished]:
    """Greedy DFlash generation. Yields TokenDelta events, then one Finished with the stats."""
    if prompt_tokens_override is not None or prompt_token_positions is not None:
        raise NotImplementedError(
            "positional sparse prefill (prompt_tokens_override + prompt_token_positions) "
            "is not available yet"
        )
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("empty prompt: at least one token is needed")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")

    stats = GenerationStats(prompt_tokens=len(ids), block_size=drafter.block_size)
    stats.accept_histogram = [0] * drafter.block_size
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    out = _Output(tokenizer, stop)
    mx.reset_peak_memory()
    t_start = time.perf_counter()

    caches = target.make_cache()
    rollback.check_supported(caches, target.layers)
    record_tape = rollback.needs_tape(caches)
    drafter.reset()

    logits = _prefill(target, drafter, caches, ids, prefill_chunk)
    rollback.quantize_kv(caches, kv_bits, kv_group_size)
    anchor = mx.argmax(logits[0, -1]).astype(mx.int32)
    first = anchor.item()
    t_first = time.perf_counter()
    stats.ttft_s = t_first - t_start
    stats.prefill_tps = len(ids) / max(stats.ttft_s, 1e-9)

    pos = len(ids)  # position of the anchor; target cache holds [0, pos)
    inflight: Verified | None = None
    reason = ""
    try:
        done = out.push([first], [False], eos, max_tokens)
        if not done:
            inflight = verify(target, caches, anchor, drafter.propose(anchor, pos), record_tape)
        yield from out.drain()
        while not done:
            if should_cancel is not None and should_cancel():
                out.reason = "cancelled"
                break
            cyc, inflight = inflight, None
            values = cyc.summary.tolist()  # the one host sync of the cycle
            accepted = values[0]
            n_keep = accepted + 1
            rollback.rewind(caches, target.layers, n_keep, cyc.block_len, cyc.tape)
            drafter.add_context(cyc.features[:, :n_keep])
            stats.cycles += 1
            stats.accepted_drafts += accepted
            stats.accept_histogram[accepted] += 1
            new = values[1 : 1 + n_keep]
            done = out.push(new, [True] * accepted + [False], eos, max_tokens)
            pos += n_keep
            if not done:
                nxt = cyc.greedy[accepted]
                inflight = verify(target, caches, nxt, drafter.propose(nxt, pos), record_tape)
            yield from out.drain()
            done = done or out.reason != ""
        reason = out.reason or "length"
    finally:
        if inflight is not None:  # queued but never used: undo it entirely
            rollback.rewind(caches, target.layers, 0, inflight.block_len, inflight.tape)
    t_end = time.perf_counter()
    stats.generated_tokens = len(out.ids)
    stats.acceptance = stats.accepted_drafts / max(stats.generated_tokens, 1)
    stats.tokens_per_cycle = (stats.accepted_drafts + stats.cycles) / max(stats.cycles, 1)
    stats.total_s = t_end - t_start
    stats.decode_tps = (stats.generated_tokens - 1) / max(t_end - t_first, 1e-9)
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    stats.finish_reason = reason
    yield from out.drain(final=True)
    yield Finished(out.text, list(out.ids), stats)


def _prefill(
    target: TargetModel, drafter: Drafter, caches: list[Any], ids: list[int], chunk: int
) -> mx.array:
    """Run the prompt through the target in chunks, feeding captured features to the draft."""
    logits = None
    for start in range(0, len(ids), chunk):
        tokens = mx.array(ids[start : start + chunk], dtype=mx.int32)[None]
        logits, features = target.forward(tokens, caches)
        drafter.add_context(features)
        mx.eval(logits[:, -1], [c.state for c in caches])
    return logits


class _Output:
    """Committed tokens, text with stop-sequence hold-back, and the finish reason."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all text released so far
        self._pending_ids: list[int] = []
        self._pending_draft: list[bool] = []
        self._raw = ""  # detokenized text not yet released
        self.reason = ""
        self.stopped_by_string = False

    def push(self, ids: list[int], from_draft: list[bool], eos: set[int], max_tokens: int) -> bool:
        """Commit ids up to EOS / max_tokens / a stop sequence; True when generation is over."""
        for tok, fd in zip(ids, from_draft):
            if tok in eos:
                self.reason = "stop"
                return True
            self.ids.append(tok)
            self._pending_ids.append(tok)
            self._pending_draft.append(fd)
            self.detok.add_token(tok)
            self._raw += self.detok.last_segment
            if self.stop and self._cut_at_stop():
                self.reason = "stop"
                self.stopped_by_string = True
                return True
            if len(self.ids) >= max_tokens:
                self.reason = "length"
                return True
        return False

    def _cut_at_stop(self) -> bool:
        window = self.text[-self.hold :] + self._raw if self.hold else self._raw
        for s in self.stop:
            i = window.find(s)
            if i >= 0:
                keep = i - (len(window) - len(self._raw))
                if keep < 0:  # stop began in already released text: cannot unsay it
                    keep = 0
                self._raw = self._raw[:keep]
                return True
        return False

    def drain(self, final: bool = False) -> Iterator[TokenDelta]:
        if final:
            self.detok.finalize()
            if not self.stopped_by_string:
                self._raw += self.detok.last_segment
        release = self._raw if (final or self.reason) else self._raw[: len(self._raw) - self.hold]
        if not self.stop:
            release = self._raw
        if release or self._pending_ids:
            self._raw = self._raw[len(release) :]
            self.text += release
            yield TokenDelta(self._pending_ids, release, self._pending_draft)
            self._pending_ids, self._pending_draft = [], []
