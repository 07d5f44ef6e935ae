"""The DFlash decoding loop: prefill with capture, then draft -> verify -> accept -> rewind.

`stream_dflash_generate` yields `TokenDelta`s and ends with one `Finished` carrying the stats.
Greedy (temperature 0): every emitted token is the target's own argmax. Sampling: the output is
distributed exactly as the target's own sampler (speculative sampling, engine/sampling.py).
Either way the draft only decides how many tokens one target pass produces. When the text
repeats itself, a cycle may verify a copy of what followed an earlier occurrence of its last
tokens instead of the model's draft (engine/lookup.py; window.py decides which). The next cycle is
queued (async) before the current tokens are handed out, so the device works while the caller
consumes text. An in-flight cycle that turns out not to be needed (stop, cancel, caller closed
the generator) is rewound in `finally`, which leaves the caches exactly at the committed tokens.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from ..daemon.protocol import shown
from . import rollback, sparse
from . import sampling as sampling_mod
from . import branches as branches_mod
from .branches import MIN_WIDTH
from .drafters import Drafter
from .lookup import CopyProposer
from .prefix import PrefixSession
from .processors import CONTEXT_SIZE, LogitsProcessors, ProcessorParams
from .sampling import DraftSampling, KeyChain, SamplingParams
from .target import TargetModel
from .verify import Verified, taught, verify
from .window import VerifyWindow, WindowMemory


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
    warnings: list[str] = field(default_factory=list)
    mean_verify_window: float = 0.0  # tokens per verify pass (see window.py)
    plain_steps: int = 0  # cycles run as plain decode steps (window 1: drafting did not pay)
    copy_cycles: int = 0  # cycles that verified a copy proposal instead of the model's draft
    confidence_windows: int = 0  # draft cycles whose window the draft's confidence chose
    copy_accepted: int = 0  # copied tokens accepted (part of accepted_drafts)
    branch_rows: int = 1  # draft rows per model-draft verify (engine/branches.py; greedy only)
    branch_cycles: int = 0  # cycles that verified several rows (the default's stop after its budget)
    branch_wins: int = 0  # cycles that kept a row other than the draft's top-1 one
    run_ahead: int = 0  # draft cycles whose draft was queued during the previous verify
    # decode tok/s x the mean plain-step time measured in this very run: how much faster than
    # plain decoding this generation went (an estimate; 0 when no plain step was timed)
    est_speedup: float = 0.0

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
    stop: str | Sequence[str] = (),
    prefill_chunk: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    prompt_tokens_override: Sequence[int] | None = None,
    prompt_token_positions: Sequence[int] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    prefill_cancel: Callable[[], bool] | None = None,
    prefix_cache: Any | None = None,
    verify_window: str | int = "auto",
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    logit_bias: dict[int, float] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = CONTEXT_SIZE,
    presence_penalty: float | None = None,
    presence_context_size: int = CONTEXT_SIZE,
    frequency_penalty: float | None = None,
    frequency_context_size: int = CONTEXT_SIZE,
    copy_draft: bool = True,
    window_memory: WindowMemory | None = None,
    branches: int | None = None,
    teacher: Sequence[int] | None = None,
) -> Iterator[TokenDelta | Finished]:
    """DFlash generation. Yields TokenDelta events, then one Finished with the stats.

    temperature 0 (default) is greedy. Otherwise each token is distributed exactly as mlx-lm's
    `make_sampler(temperature, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
    top_k=top_k)` would draw it from the target (top-p, then min-p, which always keeps the
    min_tokens_to_keep most likely tokens, then top-k on the untempered log-probs; top_p 1, min_p
    0 and top_k 0 are off). `seed` fixes the draws
    (None: a random one); the same seed and the same verify windows give the same ids (the
    "auto" window follows measured timings, so pin a window for bit-reproducible runs).

    logit_bias ({token id: bias}; ids may be decimal strings, as JSON keys are),
    repetition_penalty, presence_penalty, frequency_penalty and their *_context_size (20 each):
    mlx-lm's `make_logits_processors`, applied to the target's logits with the history mlx-lm's
    generate_step gives them (prompt + generated tokens), greedy or sampled
    (engine/processors.py). The ids (greedy) or their distribution (sampling) are those of
    mlx-lm's generation with the same processors; the draft's proposals stay unprocessed.

    verify_window: "auto" (default; see window.py), "full" (the whole block, as published), or
    a fixed number of tokens per verify (2..block size). Never changes the output (greedy) or its
    distribution (sampling), only the speed.

    copy_draft: when the last tokens occurred before (prompt or output), a cycle may verify the
    tokens that followed them instead of the model's draft, whichever window.py expects to give
    more tokens per unit of time (no draft pass at all). Deterministic proposals (q one-hot
    under sampling): like the window, it never changes the output or its distribution.

    should_cancel: asked before each cycle, and (unless prefill_cancel is given) between prefill
    chunks: a cancel there ends with no token, finish_reason "cancelled".

    prefix_cache (e.g. dflash.cache.tiers.PrefixCache; refused with sparse prefill): resume
    from the longest stored prefix of the prompt and store snapshots of this prompt's prefill.

    window_memory: the same object for every generation of this pair (the daemon keeps one):
    the "auto" window starts from what the earlier ones measured and leaves its own there.

    branches: draft rows per verify (engine/branches.py; None: the target's DFLASH_BRANCHES).
    Greedy model drafts over plain KV caches only; elsewhere one row. Never changes the output.

    teacher (timing only; greedy): the ids of a reference decoding of this prompt (mlx-lm's).
    Every verify takes them as the target's choices where it has them, so the run decodes
    exactly that text at the cost of its own passes (the target's pass and argmax still run).
    On a bf16 GPU a 16-token verify and a 1-token step round near-ties differently and the
    texts part; a teacher lets arms and mlx-lm be timed on one text (scripts/arms_ab.py
    --teach). The output is the teacher's, not a claim about the target's.
    """
    params = SamplingParams(temperature, top_p, top_k, seed, min_p, min_tokens_to_keep)
    proc_params = ProcessorParams(logit_bias, repetition_penalty, repetition_context_size, presence_penalty,
                                  presence_context_size, frequency_penalty, frequency_context_size)
    proc_params.check_vocab(target.vocab_size)
    keys = None if params.greedy else KeyChain(params.seed)  # None: greedy, no randomness
    if (problem := rollback.kv_bits_problem(kv_bits)) is not None:
        raise ValueError(problem)
    positions: list[int] | None = None
    if prompt_tokens_override is not None or prompt_token_positions is not None:
        if prompt_tokens_override is None or prompt_token_positions is None:
            raise ValueError(
                "sparse prefill needs both prompt_tokens_override and prompt_token_positions"
            )
        if kv_bits:
            raise ValueError("sparse prefill cannot be combined with kv_bits")
        if prefix_cache is not None:
            raise ValueError("sparse prefill cannot be combined with prefix_cache (its positions "
                             "are not the prompt's, so its snapshots would not match a dense prompt)")
        prompt = list(prompt_tokens_override)
        positions = list(prompt_token_positions)
        sparse.validate(prompt, positions)
    ids = prompt_ids(tokenizer, prompt, target.vocab_size)
    if not ids:
        raise ValueError("empty prompt: at least one token is needed")
    procs = LogitsProcessors(proc_params, ids) if proc_params.active else None
    stop = [stop] if isinstance(stop, str) else list(stop)  # one stop string, as the clients take it
    if not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a string or a list of strings")
    forced = None  # the teacher's ids (past their end: the target's own choice)
    if teacher is not None:
        if not params.greedy or positions is not None:
            raise ValueError("a teacher's ids time greedy runs over a dense prompt only")
        forced = mx.array([*teacher, -1], dtype=mx.int32)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__} {shown(max_tokens)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {shown(max_tokens)}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {shown(prefill_chunk)}")

    stats = GenerationStats(prompt_tokens=len(ids), block_size=drafter.block_size)
    stats.accept_histogram = [0] * drafter.block_size
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    out = _Output(tokenizer, stop)
    mx.reset_peak_memory()
    t_start = time.perf_counter()

    caches = target.make_cache()
    if positions is not None:
        caches = sparse.positioned(caches)
        warning = sparse.scatter_warning(positions)
        if warning:
            stats.warnings.append(warning)
    rollback.check_supported(caches, target.layers)
    record_tape = rollback.needs_tape(caches)
    window = VerifyWindow(drafter.block_size, verify_window, rollback.plain_step_undoable(caches),
                          memory=window_memory, short_max=getattr(drafter, "short_max", 0))
    drafter.reset(positioned=positions is not None)

    session = None
    if prefix_cache is not None and positions is None:
        session = PrefixSession(prefix_cache, ids, caches, drafter)
    start, logits = (0, None) if session is None else session.restore()
    stats.cached_prompt_tokens = start
    if start < len(ids):  # a whole-prompt hit restored the last logits: no forward needed
        logits = _prefill(target, drafter, caches, ids, prefill_chunk, positions, start, session,
                          should_cancel if prefill_cancel is None else prefill_cancel)
    if logits is None:  # cancelled between prefill chunks: no token, and the snapshots taken kept
        stats.total_s = time.perf_counter() - t_start  # ttft_s stays 0: there was no first token
        stats.finish_reason = "cancelled"
        stats.peak_memory_gb = _peak_memory_gb()
        yield Finished("", [], stats)
        return
    rollback.quantize_kv(caches, kv_bits, kv_group_size)
    last = logits[0, -1] if procs is None else procs(logits[0, -1:], len(ids))[0]
    if keys is None:
        anchor = sampling_mod.greedy_ids(last)
        if forced is not None:
            anchor = taught(anchor.reshape(1), forced[:1])[0]
    else:
        anchor = sampling_mod.sample(last, params, keys.next())
    first = anchor.item()
    if procs is not None:
        procs.extend([first])
    t_first = time.perf_counter()
    stats.ttft_s = t_first - t_start
    stats.prefill_tps = (len(ids) - start) / max(stats.ttft_s, 1e-9)

    # position of the anchor; target caches hold everything before it
    pos = positions[-1] + 1 if positions is not None else len(ids)
    first_pos = pos  # the history before the anchor at p: ids + the first p - first_pos tokens
    inflight: Verified | None = None
    reason = ""
    verified_tokens = 0

    no_drafts = mx.zeros((0,), mx.int32)  # a plain step verifies the anchor alone
    drafter_params = inspect.signature(drafter.propose).parameters
    drafter_samples = "sampling" in drafter_params
    # greedy windows re-chosen from the draft's own confidence (window.py), where it says so
    confident = keys is None and "confidence" in drafter_params
    branch_rows = target.branches if branches is None else branches
    if branch_rows < 1:
        raise ValueError(f"branches must be >= 1, got {shown(branch_rows)}")
    if (keys is not None or procs is not None or "rows" not in drafter_params
            or not rollback.rows_supported(caches)):
        branch_rows = 1  # sampled or processed cycles, ids-only drafters, other caches: one row
    stats.branch_rows = branch_rows
    by_rows = {"rows": branch_rows} if branch_rows > 1 else {}
    # the default rows stop where their KV cache copies would pass the target's budget
    row_budget = target.branch_budget if branches is None else None
    kv_per_token = branches_mod.kv_bytes_per_token(caches) if by_rows else 0

    def rows_at(p: int, k: int) -> dict[str, int]:
        """The rows a k-token verify at cache position p takes (propose's keyword)."""
        nonlocal by_rows
        if k < MIN_WIDTH or not by_rows:
            return {}
        if not branches_mod.rows_fit(branch_rows, p + k, kv_per_token, row_budget):
            by_rows = {}  # past the budget for good (the cache only grows)
        return by_rows
    # Copy drafting's lookup over the prompt and every committed token (host-side ids, known at
    # each cycle's one host read); plain decoding (window 1) never copies.
    proposer = CopyProposer() if copy_draft and window.fixed != 1 else None
    if proposer is not None:
        proposer.reset([*ids, first])
    # Feature rows of committed tokens reach the draft in one add_context per draft cycle, not one
    # per plain step (dozens of tiny ops each, all run at the next draft cycle); a fixed window
    # of 1 never drafts, so it feeds nothing.
    pending: list[mx.array] = []
    feeds_draft = window.fixed != 1

    def feed(rows: mx.array) -> None:
        if feeds_draft:
            pending.append(rows)
            if len(pending) >= 256:
                flush()

    def flush() -> None:
        if pending:
            drafter.add_context(pending[0] if len(pending) == 1 else mx.concatenate(pending, axis=1))
            pending.clear()

    def check(anchor: mx.array, drafts: mx.array, pos: int, q: mx.array | None = None) -> Verified:
        """Verify the anchor at `pos` and its drafts."""
        process = None
        if procs is not None:  # the history before this anchor is on the host already
            n_before = len(ids) + pos - first_pos
            process = lambda rows, block: procs(rows, n_before, block)  # noqa: E731
        if keys is None:
            j = pos - len(ids) + 1  # the answer index of the block's first emitted token
            taught_ids = None if forced is None else forced[j : j + 1 + drafts.shape[-1]]
            return verify(target, caches, anchor, drafts, record_tape, forced=taught_ids, process=process)
        return verify(target, caches, anchor, drafts, record_tape, params, keys.next(), q, process=process)

    def plan() -> tuple[int, list[int]]:
        """The next cycle's window and, when it verifies a copy, the copied ids (else [])."""
        copy, match = proposer.propose(drafter.block_size - 1) if proposer else ([], 0)
        k, copying = window.plan(len(copy), match / proposer.min_ngram if proposer else 1.0)
        return k, copy[: k - 1] if copying else []

    # Run-ahead (pipelined targets, greedy): when a draft cycle is likely to have all its drafts
    # accepted, its whole block goes into the draft's context and the next cycle's draft (all
    # B-1 rows) is queued behind its verify, before the verify is read: the device goes from
    # the verify straight into the next draft while the host reads, rewinds and hands out
    # tokens. A block not wholly accepted trims the rows past the kept ones (a context row
    # depends on its own feature row only) and the queued draft is dropped: a wasted draft pass,
    # hence the bet only when likely (window.likely_full). The output never depends on it.
    runs_ahead = target.run_ahead and keys is None and feeds_draft

    def launch(anchor: mx.array, pos: int, ready: mx.array | None = None) -> Verified:
        """Queue the next cycle; `ready`: its draft, run ahead by the previous cycle."""
        k, copy = plan()  # k 1: a plain decode step, no draft pass (see window.py)
        if k == 1:
            return check(anchor, no_drafts, pos)
        # a key taken by every proposal kind: the verify draws never depend on the kind
        draft_key = None if keys is None else keys.next()
        if copy:  # no draft pass; ids only, so under sampling q is one-hot at them
            cyc = check(anchor, mx.array(copy, dtype=mx.int32), pos)
            cyc.copied = True
            return cyc
        rows_here = rows_at(pos, k)
        whole = False
        if ready is not None:  # greedy only: ids of the first k-1 positions, as propose(k-1) gives
            if ready.ndim == 2 and not rows_here:
                ready = ready[0]  # the top-1 row: this window is too narrow for several
            drafts, q = ready[..., : k - 1], None
            stats.run_ahead += 1
        else:
            flush()
            if confident and not rows_here and window.reads_draft(k):
                # the whole block, and the window its confidence pays for (a second host read)
                drafts, conf = drafter.propose(anchor, pos, confidence=True)
                mx.eval(drafts, conf)
                k = window.after_draft(conf.tolist())
                drafts, q, whole = drafts[: k - 1], None, True
            elif draft_key is None or not drafter_samples:  # ids only: q is one-hot at them
                drafts, q = drafter.propose(anchor, pos, k - 1, **rows_here), None
            else:
                drafts, q = drafter.propose(anchor, pos, k - 1,
                                            sampling=DraftSampling(params, draft_key))
            if target.pipelined:  # the draft runs on the device while the verify is built
                mx.async_eval(drafts)
        cyc = check(anchor, drafts, pos, q)
        cyc.whole_block = whole
        if runs_ahead and window.likely_full(k):
            flush()
            drafter.add_context(cyc.features)
            cyc.ahead = drafter.propose(cyc.tokens[k - 1], pos + k,
                                        **rows_at(pos + k, drafter.block_size))
            mx.async_eval(cyc.ahead)
        return cyc

    try:
        done = out.push([first], [False], eos, max_tokens)
        yield from out.drain()  # the first token is known: hand it out before any cycle
        if not done:
            inflight = launch(anchor, pos)
        t_sync = time.perf_counter()
        while not done:
            if should_cancel is not None and should_cancel():
                out.reason = "cancelled"
                break
            cyc, inflight = inflight, None
            ahead = False
            if cyc.block_len == 1 and plan() == (1, []):
                # A plain step keeps its one token, so the next plain step can be queued on that
                # token while it is still on the device, before this one is read (as mlx-lm's
                # decode loop does); if this token ends generation, `finally` undoes it. Not when
                # a copy would win before that token is known: the text repeats, so read the
                # token first and look its continuation up.
                feed(cyc.features)
                inflight = check(cyc.tokens[0], no_drafts, pos + 1)
                ahead = True
            values = cyc.summary.tolist()  # the one host sync of the cycle
            now = time.perf_counter()
            cycle_s, t_sync = now - t_sync, now  # this cycle's whole cost, for the window policy
            accepted = values[0]
            n_keep = accepted + 1
            rollback.rewind(caches, target.layers, n_keep, cyc.block_len, cyc.tape)
            ready = None
            if cyc.ahead is not None:  # the draft's context holds the whole block already
                if n_keep == cyc.block_len:
                    ready = cyc.ahead
                else:
                    drafter.trim(cyc.block_len - n_keep)
            elif not ahead:
                feed(cyc.features[:, :n_keep])
            stats.cycles += 1
            stats.plain_steps += cyc.block_len == 1
            stats.accept_histogram[accepted] += 1
            stats.copy_cycles += cyc.copied
            stats.branch_cycles += cyc.rows > 1
            stats.branch_wins += cyc.rows > 1 and values[-1] != 0
            window.observe(cyc.block_len, accepted, cycle_s, cyc.copied, cyc.whole_block)
            stats.confidence_windows += cyc.whole_block
            verified_tokens += cyc.block_len
            new = values[1 : 1 + n_keep]
            if proposer is not None:
                proposer.extend(new)
            if procs is not None:
                procs.extend(new)
            handed = out.drafted
            done = out.push(new, [True] * accepted + [False], eos, max_tokens)
            stats.copy_accepted += out.drafted - handed if cyc.copied else 0  # as accepted_drafts counts
            pos += n_keep
            if not done and not ahead:
                inflight = launch(cyc.tokens[accepted], pos, ready)
            yield from out.drain()
            done = done or out.reason != ""
        reason = out.reason or "length"
    finally:
        if inflight is not None:  # queued but never used: undo it entirely
            rollback.rewind(caches, target.layers, 0, inflight.block_len, inflight.tape)
            if inflight.ahead is not None:
                drafter.trim(inflight.block_len)
        if window_memory is not None:
            window.remember(window_memory)
    t_end = time.perf_counter()
    # the last flush first: a stop string in its text can drop ids (_Output._drop_ids_past)
    tail = list(out.drain(final=True))
    reason = out.reason or reason
    stats.generated_tokens = len(out.ids)
    # drafts accepted among the tokens handed out: a cycle cut by max_tokens, EOS or a stop
    # string accepted more than it emitted, and those never count (acceptance stays <= 1)
    stats.accepted_drafts = out.drafted
    stats.acceptance = stats.accepted_drafts / max(stats.generated_tokens, 1)
    stats.tokens_per_cycle = (stats.accepted_drafts + stats.cycles) / max(stats.cycles, 1)
    stats.mean_verify_window = verified_tokens / max(stats.cycles, 1)
    stats.total_s = t_end - t_start
    # the first token's time is TTFT's: the rate is over the rest, so with none of them it is 0,
    # not (0 - 1) / t (a negative tok/s for an empty answer)
    stats.decode_tps = max(stats.generated_tokens - 1, 0) / max(t_end - t_first, 1e-9)
    # against this run's own pipelined plain steps only: the policy's median (step_s) also holds
    # unpipelined steps after draft cycles, which cost more and would flatter the estimate
    step_s = window.plain_step_mean
    if step_s and stats.generated_tokens > 1:
        stats.est_speedup = stats.decode_tps * step_s
    stats.peak_memory_gb = _peak_memory_gb()
    stats.finish_reason = reason
    yield from tail
    yield Finished(out.text, list(out.ids), stats)


def prompt_ids(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """The prompt as token ids: a str encoded, a sequence of ints checked against the target's
    vocabulary (an id past it crashed MLX's embedding lookup: a segfault, not an error)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("a prompt is a str or a sequence of token ids, not bytes (decode it first)")
    ids = []
    for t in prompt:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"token ids must be ints, got {type(t).__name__} {shown(t)}")
        t = t.__index__()
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {shown(t)} is outside the vocabulary (0..{vocab_size - 1})")
        ids.append(t)
    return ids


def context_tokens(target: Any) -> int:
    """The target's context length from its config (max_position_embeddings, times a numeric
    rope_scaling factor: YaRN / linear / dynamic extend it), 0 when it declares none. Errs long,
    never short: llama3-style scaling's max_position_embeddings is already the extended one, and
    multiplying it only makes the check more lenient."""
    args = getattr(target, "args", None)
    return _declared_context(getattr(args, "max_position_embeddings", None),
                             getattr(args, "rope_scaling", None))


def config_context_tokens(config: dict) -> int:
    """context_tokens from a config.json's fields (its text_config's where the top level has
    none), so that a length past it is refused before the weights load."""
    text = config.get("text_config")
    if "max_position_embeddings" not in config and isinstance(text, dict):
        config = text
    return _declared_context(config.get("max_position_embeddings"), config.get("rope_scaling"))


def _declared_context(n: Any, scaling: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return 0
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
        n = int(n * factor)
    return n


def context_problem(prompt_tokens: int, context: int) -> str | None:
    """Why a prompt of this many tokens cannot run in a context of `context` tokens (0: none
    declared, anything runs), else None: it must leave a position for the answer. A longer one
    ran anyway (a long prefill, then an answer from positions the model was never trained on);
    the daemon refuses it with these words too. max_tokens is not added: the answer may run on."""
    if context and prompt_tokens >= context:
        return (f"prompt of {prompt_tokens} tokens does not fit the model's context of {context} "
                "tokens (none would be left for the answer): send a shorter prompt")
    return None


def sampling_line(sampling: dict[str, Any]) -> str:
    """The sampling a run used, its seed included (drawn when none was given), so that a sampled
    run can be repeated; "" for greedy runs."""
    if not sampling.get("temperature"):
        return ""
    min_p = f", min_p {sampling['min_p']:g}" if sampling.get("min_p") else ""
    if sampling.get("min_tokens_to_keep", 1) != 1:
        min_p += f", min_tokens_to_keep {sampling['min_tokens_to_keep']}"
    return (f"sampling: temperature {sampling['temperature']:g}, top_p {sampling.get('top_p', 1.0):g}, "
            f"top_k {sampling.get('top_k', 0)}{min_p}, seed {sampling.get('seed')}")


def format_stats(s: dict[str, Any]) -> str:
    """One human line for a stats dict (GenerationStats.to_dict(), or a daemon job's stats)."""
    g = s.get
    return (
        f"[dflash] prompt {g('prompt_tokens', 0)} tok ({g('cached_prompt_tokens', 0)} cached), "
        f"{_prefill_rate(s)} | generated {g('generated_tokens', 0)} tok, "
        f"{g('decode_tps', 0):.1f} tok/s{_speedup(s)} | "
        f"acceptance {g('acceptance', 0):.1%}, "
        f"{g('tokens_per_cycle', 0):.2f} tok/cycle over {g('cycles', 0)} cycles "
        f"(verify window {g('mean_verify_window', 0):.1f}, {g('plain_steps', 0)} plain, "
        f"{g('copy_cycles', 0)} copy with {g('copy_accepted', 0)} accepted{_rows(s)}) | "
        f"TTFT {g('ttft_s', 0) * 1000:.0f} ms | "
        f"peak {g('peak_memory_gb', 0):.2f} GB | {g('finish_reason', '')}"
    )


COMPARING = "[dflash] decoding the same prompt plainly (verify window 1) to compare ..."


def plain_comparison(ids: list[int], stats: dict[str, Any], plain_ids: list[int], plain_stats: dict[str, Any],
                     greedy: bool) -> dict[str, Any]:
    """A run against the same prompt decoded plainly (verify window 1): the measured speedup of
    decode tok/s, and whether the ids agree (where they part; None: they do not)."""
    fast, slow = stats.get("decode_tps", 0.0), plain_stats.get("decode_tps", 0.0)
    parts = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), None)
    if parts is None and len(ids) != len(plain_ids):
        parts = min(len(ids), len(plain_ids))
    return {"decode_tps": slow, "generated_tokens": len(plain_ids), "speedup": fast / slow if slow else 0.0,
            "same_tokens": parts is None, "parts_at": parts, "greedy": greedy, "stats": plain_stats}


def comparison_line(plain: dict[str, Any], dflash_tps: float) -> str:
    """One human line for plain_comparison()'s dict (`--compare-plain`)."""
    if not plain["greedy"]:
        same = "sampled, so the two texts are two draws from the same distribution"
    elif plain["same_tokens"]:
        same = "the same tokens: yes"
    else:
        same = (f"the same tokens: no, they part at token {plain['parts_at']} (on a GPU in bf16 a verify and a "
                "step can round a near-tie differently; README, lossless)")
    return (f"[dflash] plain decoding: {plain['generated_tokens']} tok, {plain['decode_tps']:.1f} tok/s | "
            f"DFlash {dflash_tps:.1f} tok/s = {plain['speedup']:.2f}x plain decoding (measured) | {same}")


def _rows(s: dict[str, Any]) -> str:
    """The branches part of the stats line (engine/branches.py), when more than one row ran."""
    rows = s.get("branch_rows", 1)
    if rows <= 1:
        return ""
    return (f", {rows} draft rows on {s.get('branch_cycles', 0)} cycles, "
            f"{s.get('branch_wins', 0)} kept a swapped row")


def _prefill_rate(s: dict[str, Any]) -> str:
    """Prefill speed, or "nothing to prefill" when the prefix cache held the whole prompt (its
    rate, 0 tokens over the restore, would read as a stall)."""
    if s.get("prompt_tokens", 0) and s.get("cached_prompt_tokens", 0) >= s.get("prompt_tokens", 0):
        return "nothing to prefill"
    return f"{s.get('prefill_tps', 0):.1f} tok/s"


def _speedup(s: dict[str, Any]) -> str:
    """The estimate against plain decoding; none for a run of plain steps only (window 1), which
    would compare plain decoding with itself."""
    x = s.get("est_speedup", 0)
    if not x or s.get("plain_steps", 0) >= s.get("cycles", 0):
        return ""
    return f" (~{x:.2f}x plain decoding, est.)"


def _peak_memory_gb() -> float:
    """MLX's device peak; on backends that do not track it, the process's peak RSS."""
    peak = mx.get_peak_memory()
    if peak:
        return peak / 1e9
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)


def _prefill(
    target: TargetModel,
    drafter: Drafter,
    caches: list[Any],
    ids: list[int],
    chunk: int,
    positions: list[int] | None = None,
    start: int = 0,
    session: PrefixSession | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> mx.array | None:
    """Run ids[start:] through the target in chunks, feeding captured features to the draft;
    None when `cancelled` says so between two chunks (a long prompt's prefill took minutes on a
    CPU, and a cancel or a client's disconnect waited for all of it).

    With `positions` (sparse prefill) each contiguous run starts at its true position.
    Dense chunks end on a grid of absolute positions and at the prefix session's marks, where
    the caches are captured: a run resumed from a mark computes exactly what a cold run does.
    """
    logits = None
    marks = set(session.marks) if session is not None else set()
    spans = sparse.runs(positions) if positions is not None else [(start, len(ids))]
    for lo, hi in spans:
        if positions is not None:
            sparse.jump(caches, positions[lo])
            drafter.jump(positions[lo])
        base = lo if positions is not None else 0
        ends = sorted({*range(base + chunk, hi, chunk), *marks, hi})
        for end in (e for e in ends if lo < e <= hi):
            tokens = mx.array(ids[lo:end], dtype=mx.int32)[None]
            logits, features = target.forward(tokens, caches, last_only=True)
            drafter.add_context(features)
            mx.eval(logits, [c.state for c in caches])
            if end in marks:
                session.capture(end, logits)
            lo = end
            if lo < len(ids) and cancelled is not None and cancelled():  # not after the last chunk
                return None
    return logits


class _Output:
    """Committed tokens, text with stop-sequence hold-back, and the finish reason.

    Each TokenDelta carries one cycle's ids and the text they completed. Ids whose text the
    detokenizer still holds (the first bytes of a multi-byte character, a lone space) wait and go
    with the delta that releases that text: a later cycle's, or the final flush (a lone U+FFFD for
    a cut character, as mlx-lm writes it). So the flush carries its ids however generation ends,
    also when the last cycle brought none (an EOS first in its cycle, a cancel), where it used to
    come as text without ids; the text itself is never held back for this. Concatenated, the
    deltas' text and ids are the Finished text and ids. A stop string ends the ids at the one
    whose text completed it, also when that text was held and came out with later ids.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all text released so far
        self._pending_ids: list[int] = []  # ids whose text is out of the detokenizer: next delta's
        self._pending_draft: list[bool] = []
        self._held: list[tuple[int, bool]] = []  # ids whose text the detokenizer still holds
        self._raw = ""  # detokenized text not yet released
        self._flushed = False  # the detokenizer was finalized
        self.reason = ""
        self.stopped_by_string = False
        self.drafted = 0  # committed ids that were accepted drafts

    def push(self, ids: list[int], from_draft: list[bool], eos: set[int], max_tokens: int) -> bool:
        """Commit ids up to EOS / max_tokens / a stop sequence; True when generation is over."""
        for tok, fd in zip(ids, from_draft):
            if tok in eos:
                self.reason = "stop"
                return True
            self.ids.append(tok)
            self.drafted += fd
            self._held.append((tok, fd))
            self.detok.add_token(tok)
            segment = self.detok.last_segment
            fresh = len(self._held) if segment else 0  # the ids this segment writes
            if segment:  # the detokenizer let go of the text of every id it held
                self._raw += segment
                self._release_held()
            if self.stop and self._stop_cuts(fresh):
                self.reason = "stop"
                self.stopped_by_string = True
                return True
            if len(self.ids) >= max_tokens:
                self.reason = "length"
                return True
        return False

    def _stop_cuts(self, fresh: int) -> bool:
        """Cut the unreleased text at the earliest stop string, and keep the ids up to the one
        that completed it; `fresh`: how many ids the last release of text wrote."""
        window = self.text[-self.hold :] + self._raw if self.hold else self._raw
        # the earliest stop in the window, not the first in the list: one segment can hold
        # several, and a cut at a later one would leave an earlier one in the text
        found = [(i, i + len(s)) for s in self.stop if (i := window.find(s)) >= 0]
        if not found:
            return False
        start, end = min(found)
        released = len(window) - len(self._raw)  # the window's released part, before _raw
        needed = self.text + self._raw[: max(end - released, 0)]  # the whole text up to the stop's end
        self._raw = self._raw[: max(start - released, 0)]  # a stop begun in released text: cannot unsay it
        if fresh > 1:
            self._drop_ids_past(needed, fresh)
        return True

    def _drop_ids_past(self, needed: str, fresh: int) -> None:
        """Of the last `fresh` ids (one release of text), drop those after the one whose text
        completed the stop (`needed`: the whole text up to the stop's end). The detokenizer holds
        a lone space or a character's first bytes and writes them with a later id; when the held
        text completed the stop, that later id's text is all cut and the id must not count: the
        ids end where they end when nothing was held. Rare (a stop found in held text), so the
        prefixes' text is rebuilt by replaying their ids."""
        base = len(self.ids) - fresh
        for n in range(base + 1, len(self.ids)):
            if not self._text_of(self.ids[:n]).startswith(needed):
                continue
            cut = len(self.ids) - n
            self.drafted -= sum(self._pending_draft[-cut:])
            del self.ids[n:], self._pending_ids[-cut:], self._pending_draft[-cut:]
            return

    def _text_of(self, ids: list[int]) -> str:
        """The text a fresh copy of the detokenizer writes for `ids`, flushed."""
        probe = copy.copy(self.detok)
        probe.reset()  # rebinds the copy's state: the live detokenizer is untouched
        for tok in ids:
            probe.add_token(tok)
        probe.finalize()
        return probe.text

    def _release_held(self) -> None:
        self._pending_ids.extend(t for t, _ in self._held)
        self._pending_draft.extend(d for _, d in self._held)
        self._held = []

    def drain(self, final: bool = False) -> Iterator[TokenDelta]:
        """This cycle's delta. At the end (a finish reason set, or `final`) the detokenizer is
        flushed into it and everything held back is released."""
        ending = final or bool(self.reason)
        if ending and not self._flushed:
            self._flushed = True
            self.detok.finalize()
            fresh = len(self._held)
            self._release_held()  # the flush's ids travel with it
            if not self.stopped_by_string:
                self._raw += self.detok.last_segment
                # the flush can write text the detokenizer held (a lone space, a cut character)
                # that completes a stop string: cut there too, as push does
                if self.stop and self._stop_cuts(fresh):
                    self.stopped_by_string = True
                    if self.reason == "length":
                        self.reason = "stop"
        release = self._raw if (ending or not self.stop) else self._raw[: max(len(self._raw) - self.hold, 0)]
        if release or self._pending_ids:
            self._raw = self._raw[len(release) :]
            self.text += release
            yield TokenDelta(self._pending_ids, release, self._pending_draft)
            self._pending_ids, self._pending_draft = [], []
