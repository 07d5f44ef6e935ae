"""How many of the draft's tokens to verify each cycle.

The draft always proposes a whole block in one pass; verifying all of it is right when the draft is
good or when a wide verify costs about as much as one decode step (GPUs: M=16 costs ~1.5 steps).
On a CPU a 16-token verify costs ~2.4 steps, so a draft accepted only half the time is better
verified a few tokens at a time. "auto" picks the window k that maximises expected tokens per unit
of time: with per-token acceptance p (geometric, estimated from recent cycles) a window of k emits
E(k) = 1 + p + ... + p^(k-1) tokens, and costs 1 + d + c*(k-1) decode steps (d: the draft pass,
c: each extra verified token). The output never depends on k: only the speed does.
"""

from __future__ import annotations

import os

import mlx.core as mx

# (c, d) per backend, in units of one decode step: measured on SmolLM2-135M fp32 + MKL (CPU,
# M=16 / M=1 = 2.4) and on an 8B shape in bf16 (H200, M=16 / M=1 = 1.4-1.55).
DEFAULT_COSTS = {"cpu": (0.09, 0.2), "gpu": (0.035, 0.3)}


class VerifyWindow:
    """Chooses the verify window each cycle; `fixed` pins it (tests, the published method)."""

    def __init__(self, block_size: int, policy: str | int = "auto", decay: float = 0.9):
        self.block_size = block_size
        if policy == "auto":
            self.fixed = None
        elif policy == "full":
            self.fixed = block_size
        else:
            k = int(policy)
            if not 2 <= k <= block_size:
                raise ValueError(f"verify window must be 2..{block_size}, 'auto' or 'full'; got {policy}")
            self.fixed = k
        self.decay = decay
        self.successes, self.failures = 4.0, 1.0  # prior: p = 0.8
        self.c, self.d = _costs()

    @property
    def p(self) -> float:
        return self.successes / (self.successes + self.failures)

    def next(self) -> int:
        if self.fixed is not None:
            return self.fixed
        p, best, best_rate = min(self.p, 0.999), 2, 0.0
        expected = 1.0
        for k in range(2, self.block_size + 1):
            expected += p ** (k - 1)
            rate = expected / (1.0 + self.d + self.c * (k - 1))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def observe(self, window: int, accepted: int) -> None:
        """A cycle verified window-1 drafts and accepted the first `accepted` of them."""
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1 if accepted < window - 1 else 0)


def _costs() -> tuple[float, float]:
    env = os.environ.get("DFLASH_VERIFY_COST")
    if env:
        c, d = (float(x) for x in env.split(","))
        return c, d
    return DEFAULT_COSTS["gpu" if mx.default_device() == mx.gpu else "cpu"]
