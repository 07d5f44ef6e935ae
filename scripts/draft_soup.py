"""Average drafts' weights (a "soup"): one training lever that costs no device time.

    python scripts/draft_soup.py OUT DRAFT DRAFT [DRAFT ...] [--weights 0.5,0.5]

The drafts must share a config (same shapes); the usual case is checkpoints along one training
line (the bundled draft and the campaign runs that continued it), where the average sits on
the segment between them. The mean is taken in fp32 and written in the first draft's dtype,
as a checkpoint folder (engine/training/checkpoint.write_parts) with the first draft's
config.json and draft_vocab.json; soup.json records the sources. It has no trainer.json: a
soup carries no step, schedule or moments of its own, so `train-draft --init-draft` starts anew
from it. `--campaign DRAFT` gives it that draft's trainer.json (step, schedule, data state;
never its optimizer moments, which belong to other weights), so that `train-draft --resume SOUP
--restart-lr ...` goes on with the campaign from the soup, re-warming fresh moments as any resume
without them does (session 40 did this by hand: soup B with session 35's trainer.json).

Session 38 (2-core CPU, fp32, `DFLASH_DRAFT_VOCAB=full dflash eval-draft --max-tokens 128`):
the bundled draft and session 35's averaged 62.2% / 2.65 (session 35's own 62.1% / 2.65),
with session 36's too 62.5% / 2.67 (the bundled draft 61.4% / 2.60), and that one decoded at
1.000x of the bundled draft's speed in one process: a tie. Past session 35's draft on the line
from the bundled one (`--weights=-0.5,1.5` and `=-1,2`) held-out fell to 2.56 and 2.40: the line
peaks between them. benchmark/training/campaign/session38/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash.engine.training.checkpoint import load_draft_any, write_parts


def soup(folders: list[Path], weights: list[float]) -> dict[str, mx.array]:
    """The weighted mean of the drafts' parameters: sum(w * p) / sum(w) in fp32, cast to the
    first draft's dtypes (equal weights: the plain sum over the count, as session 38 ran it)."""
    if len(folders) != len(weights) or len(folders) < 2:
        raise ValueError("give two or more drafts and one weight each")
    if sum(weights) <= 0:
        raise ValueError(f"weights must sum to more than 0, got {weights}")
    configs = [json.loads((f / "config.json").read_text()) for f in folders]
    if any(c != configs[0] for c in configs[1:]):
        raise ValueError("the drafts' config.json differ: only drafts of one shape can be averaged")
    params = [dict(tree_flatten(load_draft_any(f).parameters())) for f in folders]
    out = {}
    for name, first in params[0].items():
        total = sum(w * p[name].astype(mx.float32) for w, p in zip(weights, params))
        out[name] = (total / sum(weights)).astype(first.dtype)
    mx.eval(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/draft_soup.py", description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("drafts", nargs="+")
    ap.add_argument("--weights", default=None, help="comma-separated, one a draft, normalised to sum to 1 "
                                                    "(default: equal); a negative one extrapolates "
                                                    "(--weights=-0.5,1.5: half the way from D1 to D2 again past D2)")
    ap.add_argument("--campaign", default=None, metavar="DRAFT",
                    help="a checkpoint whose trainer.json the soup takes (step, schedule, data "
                         "state; not its optimizer moments), so train-draft --resume continues from it")
    args = ap.parse_args(argv)
    folders = [Path(d) for d in args.drafts]
    trainer = None
    if args.campaign:
        try:
            trainer = json.loads((Path(args.campaign) / "trainer.json").read_text())
        except FileNotFoundError:
            ap.error(f"--campaign {args.campaign}: no trainer.json there (a training checkpoint has one)")
        except ValueError as e:
            ap.error(f"--campaign {args.campaign}: trainer.json is not JSON ({e})")
    try:
        weights = [float(x) for x in args.weights.split(",")] if args.weights else [1.0] * len(folders)
    except ValueError:
        ap.error(f"--weights must be numbers separated by commas, got {args.weights!r}")
    out = Path(args.out)
    if out.exists():
        ap.error(f"{out} exists; give a new folder")
    try:
        averaged = soup(folders, weights)
    except (ValueError, FileNotFoundError) as e:
        print(f"draft_soup: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True)
    write_parts(averaged, out)
    shutil.copy(folders[0] / "config.json", out / "config.json")
    if (folders[0] / "draft_vocab.json").is_file():
        shutil.copy(folders[0] / "draft_vocab.json", out / "draft_vocab.json")
    shares = [w / sum(weights) for w in weights]
    (out / "soup.json").write_text(json.dumps(
        {"soup": [{"draft": str(f), "weight": w} for f, w in zip(folders, shares)],
         "campaign": args.campaign}, indent=1) + "\n")
    if trainer is not None:  # last: a folder with trainer.json is a whole checkpoint
        trainer = dict(trainer, optimizer_saved=False, soup=str(out / "soup.json"))
        (out / "trainer.json").write_text(json.dumps(trainer, indent=2) + "\n")
    print(f"{out}: the mean of {len(folders)} drafts ({', '.join(f'{w:g}' for w in shares)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
