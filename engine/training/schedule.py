"""The learning-rate schedule: a pure function of the global step (the campaign's clock).

Update u (1-based: the u-th optimiser step of the whole campaign, over all sessions) uses
    lr(u) = lr * u / warmup                                     for u <= warmup
          = min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2      p = (u - warmup) / (total - warmup)
and min_lr after `total`. A session's --max-steps / --time-budget-s only stop that session.
A resume without the optimiser's moments re-warms: for `rewarmup_steps` updates after the resume
step R, lr(u) * min(1, (u - R) / rewarmup_steps) (fresh Adam moments must not take full steps).
A warm restart (SGDR, `restart(step, lr)`: train-draft --restart-lr) starts a new cosine at step C
from a new peak: for u > C, p = (u - C) / (total - C); a late session can explore at a high lr again
and still end annealed, where re-stretching the one cosine only moves along its tail.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class Schedule:
    lr: float
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float = 0.0
    rewarmup_from: int | None = None  # global step of a resume without moments
    rewarmup_steps: int = 0
    cycle_from: int = 0  # a warm restart's step (0: one cosine from the campaign's start)

    def base(self, u: int) -> float:
        start = self.warmup_steps
        if self.cycle_from and u > self.cycle_from:
            start = self.cycle_from  # the restart's warm-up is the re-warm (rewarm_factor)
        elif u <= self.warmup_steps:
            return self.lr * max(u, 1) / max(self.warmup_steps, 1)
        span = max(self.total_steps - start, 1)
        p = min((u - start) / span, 1.0)
        lo = self.lr * self.min_lr_ratio
        return lo + (self.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * p))

    def rewarm_factor(self, u: int) -> float:
        if self.rewarmup_from is None or self.rewarmup_steps <= 0 or u <= self.rewarmup_from:
            return 1.0
        return min(1.0, (u - self.rewarmup_from) / self.rewarmup_steps)

    def __call__(self, u: int) -> float:
        return self.base(u) * self.rewarm_factor(u)

    def restart(self, step: int, lr: float) -> None:
        """A new cosine from `lr` at `step` down to lr x min_lr_ratio at total_steps."""
        if self.total_steps <= step:
            raise ValueError(f"a restart at step {step} needs --total-steps beyond it (now {self.total_steps})")
        self.cycle_from, self.lr = step, lr

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def warmup_steps_for(warmup: float, total_steps: int) -> int:
    """--warmup: a fraction of the campaign (< 1) or a number of steps (>= 1)."""
    return int(round(warmup * total_steps)) if warmup < 1 else int(warmup)
