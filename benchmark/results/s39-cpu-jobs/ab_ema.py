"""One-off (session 39): scripts/arms_ab.py with an arm named "ema" that runs the window's overheads
as the old running mean (first measurement replaces the prior, then 0.8 old + 0.2 new), beside the
median of the last 7 (every other arm). Arguments as arms_ab.py's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # the checkout's scripts/
import arms_ab  # noqa: E402
import dflash.engine.window as W  # noqa: E402

orig = arms_ab._generate


def ema(samples, new):
    samples.append(new)
    it = iter(samples)
    v = next(it)
    for x in it:
        v = 0.8 * v + 0.2 * x
    return v


def gen(pair, arm, ids, max_tokens, teacher=None):
    if arm is not None and arm.name == "ema":
        saved = W._measured, W.OVERHEAD_SAMPLES
        W._measured, W.OVERHEAD_SAMPLES = ema, 10**6
        try:
            return orig(pair, arm, ids, max_tokens, teacher)
        finally:
            W._measured, W.OVERHEAD_SAMPLES = saved
    return orig(pair, arm, ids, max_tokens, teacher)


arms_ab._generate = gen
arms_ab.main()
