"""One timed run of each engine, on one clock, and the cost model's forward timings.

Why a module of its own: these are the measurements themselves (mlx-lm's stream_generate, DFlash's
stream_dflash_generate, t(verify) / t(step) / t(draft)), the same clock and formulas for both
engines; the protocol around them (rows.py) decides which prompts they run on, and scripts
(arms_ab, text_check, window_sim) time their own arms with these same functions.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx

from .. import rollback
from .. import tape as tape_mod
from ..drafters import DFlashDrafter, Drafter
from ..generate import Finished, stream_dflash_generate
from ..sampling import SamplingParams
from ..target import TargetModel
from ..window import WindowMemory
from .setup import Setup

FORWARD_WARMUP = 3  # untimed step/verify pairs before the timed ones in time_forward


# --- one run of each engine ---------------------------------------------------------------------


def _timing(n_prompt: int, ids: list[int], t0: float, t_first: float, t_end: float) -> dict:
    """The same clock and formulas for both engines."""
    n = len(ids)
    ttft = t_first - t0
    return {
        "prompt_tokens": n_prompt,
        "generated_tokens": n,
        "ttft_s": ttft,
        "prefill_tps": n_prompt / max(ttft, 1e-9),
        "decode_tps": (n - 1) / max(t_end - t_first, 1e-9) if n > 1 else 0.0,
        "e2e_tps": n / max(t_end - t0, 1e-9),
        "total_s": t_end - t0,
    }


Sampling = SamplingParams  # one run's sampling: greedy (temperature 0) or mlx-lm's make_sampler's
GREEDY = Sampling()


def run_baseline(
    setup: Setup, ids: list[int], max_tokens: int, sampling: Sampling = GREEDY
) -> tuple[list[int], dict]:
    """mlx-lm's stream_generate on the same model: greedy (its default sampler is argmax), or
    `make_sampler(temperature, top_p=..., min_p=..., min_tokens_to_keep=..., top_k=...)` with
    MLX's global seed set to `seed`."""
    from mlx_lm.generate import stream_generate

    sampler = None
    if not sampling.greedy:
        from mlx_lm.sample_utils import make_sampler

        sampler = make_sampler(sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p,
                               min_tokens_to_keep=sampling.min_tokens_to_keep, top_k=sampling.top_k)
        mx.random.seed(sampling.seed or 0)
    eos = setup.tokenizer.eos_token_ids
    mx.synchronize()
    mx.reset_peak_memory()
    out: list[int] = []
    reason = ""
    stop_token = None
    self_tps = 0.0
    t_first: float | None = None
    t0 = time.perf_counter()
    for r in stream_generate(setup.target.model, setup.tokenizer, mx.array(ids), max_tokens,
                             sampler=sampler):
        if t_first is None:
            t_first = time.perf_counter()
        reason = r.finish_reason or reason
        self_tps = r.generation_tps
        if not (r.finish_reason == "stop" and r.token in eos):
            out.append(int(r.token))
        else:
            stop_token = int(r.token)
    t_end = time.perf_counter()
    mx.synchronize()  # its pipelined loop may hold one discarded step in flight
    rec = _timing(len(ids), out, t0, t_first or t_end, t_end)
    rec.update(peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=reason,
               stop_token=stop_token,  # the end-of-sequence id it stopped on (not in `out`)
               self_reported_decode_tps=self_tps)  # mlx-lm's own generation_tps
    return out, rec


def run_dflash(
    setup: Setup, drafter: Drafter, ids: list[int], max_tokens: int, window: str = "auto",
    sampling: Sampling = GREEDY, copy_draft: bool = True, teacher: list[int] | None = None,
    window_memory: WindowMemory | None = None,
) -> tuple[list[int], dict]:
    """stream_dflash_generate on the same prompt ids, timed with the baseline's clock
    (`teacher`: a reference decoding's ids to decode; `window_memory`: what earlier runs'
    verify windows measured, as the daemon hands it on; see stream_dflash_generate)."""
    mx.synchronize()
    final: Finished | None = None
    t0 = time.perf_counter()
    gen = stream_dflash_generate(
        setup.target, drafter, setup.tokenizer, ids, max_tokens, verify_window=window,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        min_p=sampling.min_p, min_tokens_to_keep=sampling.min_tokens_to_keep,
        seed=sampling.seed, copy_draft=copy_draft, teacher=teacher, window_memory=window_memory,
    )
    for ev in gen:
        if isinstance(ev, Finished):
            final = ev
    t_end = time.perf_counter()
    mx.synchronize()
    assert final is not None
    s = final.stats
    # the first token's moment from the engine's own clock, not the first delta's: a delta waits
    # for the text its ids complete (a lone space, a character's first bytes), so the first one
    # can come a cycle late, which would drop that cycle from the decode time. The engine's clock
    # starts after t0, so this moment is a little early: the decode time a little long, if anything
    t_first = t0 + s.ttft_s if s.generated_tokens else None
    rec = _timing(len(ids), final.token_ids, t0, t_first or t_end, t_end)
    rec.update(
        peak_memory_gb=s.peak_memory_gb,
        finish_reason=s.finish_reason,
        self_reported_decode_tps=s.decode_tps,  # the engine's own clock
        acceptance=s.acceptance,
        tokens_per_cycle=s.tokens_per_cycle,
        cycles=s.cycles,
        accepted_drafts=s.accepted_drafts,
        accept_histogram=list(s.accept_histogram),
        copy_cycles=s.copy_cycles,
        confidence_windows=s.confidence_windows,
        run_ahead=s.run_ahead,
        engine_stats=s.to_dict(),
    )
    return list(final.token_ids), rec


def compare_ids(got: list[int], want: list[int]) -> dict:
    """Losslessness of one DFlash run against the baseline's ids for the same prompt."""
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if mismatch is None and len(got) != len(want):
        mismatch = min(len(got), len(want))
    return {"lossless": mismatch is None, "first_mismatch": mismatch}


# --- t(verify) / t(decode step) / t(draft) ------------------------------------------------------
def time_forward(
    target: TargetModel, ids: list[int], block: int, iters: int = 10,
    warmup: int = FORWARD_WARMUP, chunk: int = 512, draft: Any | None = None,
    draft_vocab: list[int] | None = None,
) -> dict:
    """Median times of a target forward over M=block tokens, over M=1, and of the draft pass.

    This is the cost model of speculative decoding: a cycle pays one draft pass and one M=block
    forward instead of tokens_per_cycle M=1 steps. Every timed forward runs at a cache length it
    never ran at: iteration i steps one token at n+i (kept), drafts a block after it, verifies
    M=block at n+i+1 and rewinds that verify; the next step is at n+i+1. Each is synced (mx.eval)
    on its own, interleaved so drift hits all alike. `draft` (a DFlashDraft, optional): its whole
    block + the LM head on block-1 rows, as a cycle runs it, fed the features computed here
    (over `draft_vocab` only when given, as the drafter of the runs scores it).

    `verify_revisited_ms`: each verify is run a second time at once at the same shape (same
    tokens, same cache length; None where a recurrent cache keeps a token per verify), so a
    per-shape cache (MLX-CUDA's cuDNN attention graphs, matmul plans) shows as the first-time
    verify costing more than the revisited one, measured in the same process and interleaved.
    This is what a benchmark that re-runs one prompt (`--chat`) may gain over a real request.
    """
    caches = target.make_cache()
    drafter = DFlashDrafter(draft, target, draft_vocab) if draft is not None else None
    for s in range(0, len(ids), chunk):
        logits, feats = target.forward(mx.array(ids[s : s + chunk], dtype=mx.int32)[None], caches,
                                       last_only=True)
        if drafter is not None:
            drafter.add_context(feats)
            mx.eval([c.state for c in drafter.cache])
        mx.eval(logits, [c.state for c in caches])
    record = rollback.needs_tape(caches)
    keep = 1 if record else 0  # a recurrent state is replayed over >= 1 step
    vocab = target.vocab_size
    pos = len(ids)

    def forward(m: int) -> float:
        nonlocal pos
        toks = mx.array([(7 * (pos + j) + 11) % vocab for j in range(m)], dtype=mx.int32)[None]
        tp = tape_mod.Tape() if record and m > 1 else None
        t0 = time.perf_counter()
        with tape_mod.recording(tp):
            logits, feats = target.forward(toks, caches)
        mx.eval(mx.argmax(logits[0], axis=-1), feats)
        dt = time.perf_counter() - t0
        kept = m if m == 1 else keep
        if m > 1:
            rollback.rewind(caches, target.layers, keep, m, tp)
        if drafter is not None and kept:
            drafter.add_context(feats[:, :kept])
        pos += kept
        return dt

    def draft_pass() -> float:
        if drafter is None:
            return 0.0
        anchor = mx.array((7 * pos + 11) % vocab, dtype=mx.int32)
        mx.eval([c.state for c in drafter.cache])
        t0 = time.perf_counter()
        out = drafter.propose(anchor, pos)
        mx.eval(out[0] if isinstance(out, tuple) else out)
        return time.perf_counter() - t0

    revisit = keep == 0  # a verify rewound to nothing: the next verify is at the same shape
    step, ver, again, drf = [], [], [], []
    for i in range(warmup + iters):
        t1 = forward(1)
        td = draft_pass()
        tb = forward(block)  # first time at this shape
        ta = forward(block) if revisit else None  # the same shape again
        if i >= warmup:
            step.append(t1)
            drf.append(td)
            ver.append(tb)
            if ta is not None:
                again.append(ta)
    t1, tb = statistics.median(step), statistics.median(ver)
    out = {"block_size": block, "step_ms": t1 * 1e3, "verify_ms": tb * 1e3, "ratio": tb / t1,
           "iters": iters, "context": len(ids)}
    out["verify_revisited_ms"] = statistics.median(again) * 1e3 if again else None
    out["draft_ms"] = statistics.median(drf) * 1e3 if drafter is not None else None
    return out
