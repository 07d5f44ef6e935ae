"""Copy drafting: propose the continuation of an earlier occurrence of the text's last tokens.

Text often repeats itself: code edited in place, quoted context, list items, a target stuck in a
loop. When the last n tokens (n = max_ngram down to min_ngram) occurred before, the tokens that
followed that occurrence are a free draft: no draft pass, only a dictionary lookup. If the match
is periodic (the occurrence ends inside the current suffix, as in "1. 1. 1."), the proposal keeps
repeating the period. Verification is the same as for the model's draft, so output is unchanged.

The index is incremental: each committed token adds one entry per n-gram size, mapping the n-gram
that ends just before it to where it sits (the latest occurrence wins). N-grams are keyed by a
64-bit polynomial hash, so a long prompt is indexed with numpy in a few milliseconds (tuples
cost ~90 ms at 32K tokens, all of it before the first token); a match is checked token by token,
so a hash collision can only lose a proposal, never make a wrong one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_BASE = 0x100000001B3  # FNV-1a's 64-bit prime: the polynomial hash's base
_MASK = (1 << 64) - 1


def _gram_hash(tokens: Sequence[int]) -> int:
    """Horner's sum(t_i * BASE^(n-1-i)) mod 2^64: the same value `_all_gram_hashes` computes."""
    h = 0
    for t in tokens:
        h = (h * _BASE + t) & _MASK
    return h


def _all_gram_hashes(a: np.ndarray, n: int) -> np.ndarray:
    """The hash of every window a[s:s+n] (uint64 arithmetic wraps mod 2^64, as `_gram_hash` masks)."""
    powers = np.array([pow(_BASE, n - 1 - i, 1 << 64) for i in range(n)], dtype=np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(a, n)
    out = np.zeros(len(windows), dtype=np.uint64)
    for i in range(n):  # column by column: no overflow warnings, exact mod 2^64
        out += windows[:, i] * powers[i]
    return out


class CopyProposer:
    """Longest-suffix n-gram lookup over the prompt and the committed tokens."""

    def __init__(self, min_ngram: int = 3, max_ngram: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.history: list[int] = []
        # per n-gram size: n-gram hash -> index of the token that followed its latest occurrence
        self._index: dict[int, dict[int, int]] = {}
        self.reset()

    def reset(self, ids: Sequence[int] = ()) -> None:
        """Index `ids` (a prompt) from scratch, all n-grams at once."""
        self.history = [int(t) for t in ids]
        a = np.asarray(self.history, dtype=np.uint64)
        self._index = {}
        for n in range(self.min_ngram, self.max_ngram + 1):
            if len(a) > n:  # windows followed by a token: a[s:s+n] -> s+n, for s < len - n
                ends = np.arange(n, len(a))
                self._index[n] = dict(zip(_all_gram_hashes(a[:-1], n).tolist(), ends.tolist()))
            else:
                self._index[n] = {}

    def extend(self, ids: Sequence[int]) -> None:
        """Commit tokens (in order); each makes the n-grams just before it findable."""
        h = self.history
        for tok in ids:
            end = len(h)  # the new token's index: the n-grams ending here are followed by it
            for n, table in self._index.items():
                if end >= n:
                    table[_gram_hash(h[end - n : end])] = end
            h.append(int(tok))

    def propose(self, count: int) -> tuple[list[int], int]:
        """Up to `count` tokens continuing the longest matched suffix, and that match's length.

        ([], 0) when the last min_ngram tokens never occurred before.
        """
        h = self.history
        L = len(h)
        if count < 1:
            return [], 0
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self._index[n].get(_gram_hash(h[L - n :]))
            if start is None or h[start - n : start] != h[L - n :]:
                continue
            period = L - start  # the continuation of h[start-n:start] is h[start:], period apart
            out: list[int] = []
            for j in range(count):
                out.append(h[start + j] if start + j < L else out[j - period])
            return out, n
        return [], 0


class CopyAcceptance:
    """Running per-token acceptance of copy proposals (decayed counts; prior 0.5)."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.successes, self.failures = 1.0, 1.0
        self.observed = 0  # copy cycles seen

    @property
    def p(self) -> float:
        return self.successes / (self.successes + self.failures)

    def observe(self, proposed: int, accepted: int) -> None:
        self.observed += 1
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1 if accepted < proposed else 0)
