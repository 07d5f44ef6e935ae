"""--time-budget-s, checked after every training step without a host sync of its own.

Read at log steps only, a budget was overshot by up to a whole --log-every interval. One process
reads its clock after queueing each step (MLX bounds how far the host runs ahead of the device,
so the clock is the device's progress within about a step). Ranks must stop at the same step, so
they compare clocks collectively, which syncs: every few steps, about CHECK_S seconds apart by the
pace rank 0 measured, and at the step where that pace says the budget runs out.
"""

from __future__ import annotations

import math
import time
from typing import Callable

CHECK_S = 1.0  # seconds between the ranks' collective checks (the most a budget is overshot by)

# (this rank's value, this rank's flag) -> (rank 0's value, whether any rank flags); a collective
Share = Callable[[float, bool], tuple[float, bool]]


class Budget:
    """The session's training-time budget (None: none), started once the compile steps are done."""

    def __init__(self, seconds: float | None, ranks: int, share: Share) -> None:
        self.seconds, self.ranks, self.share = seconds, ranks, share
        self.t0 = time.perf_counter()
        self.start_step = self.next_check = self.every = 0

    def start(self, step: int) -> None:
        self.t0, self.start_step = time.perf_counter(), step
        self.next_check, self.every = step + 1, 1

    def spent(self) -> float:
        return time.perf_counter() - self.t0

    def over(self, step: int) -> bool:
        """Whether the budget is spent after `step` (call it at every step, on every rank)."""
        if not self.seconds:
            return False
        if self.ranks == 1:
            return self.spent() >= self.seconds
        if step < self.next_check:
            return False
        spent, over = self.share(self.spent(), self.spent() >= self.seconds)
        self._plan(step, spent)
        return over

    def _plan(self, step: int, spent: float) -> None:
        """The next collective check, from rank 0's pace (the same on every rank): about CHECK_S
        seconds on, doubling from one step while the pace is new, or where the budget runs out."""
        pace = spent / max(step - self.start_step, 1)
        self.every = max(1, min(2 * self.every, int(CHECK_S / max(pace, 1e-9))))
        left = math.ceil((self.seconds - spent) / max(pace, 1e-9))
        self.next_check = step + max(1, min(self.every, left))
