"""Does the auto window recover from a pessimistic remembered cost? (session 35)

Runs one prompt several times in one process with one shared WindowMemory, as a daemon's jobs
share theirs, starting from a stored d_short (the overhead of a draft cut to a 2-token window, in
plain steps) that is too high. Before session 35 a stored 0.8 kept the demo prompt 120 of 135
cycles plain (22.7 tok/s, where the same text drafts at 26-28); set DFLASH_WINDOW_TRACE=FILE to
see the policy's view cycle by cycle.

    python scripts/window_lockin.py --model models/SmolLM2-135M-Instruct --runs 3 --d-short 0.8
"""

from __future__ import annotations

import argparse

from dflash.engine import accel

DEMO_PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompt", default=DEMO_PROMPT)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--d-short", type=float, default=0.8, help="the remembered cut-block overhead to start from")
    ap.add_argument("--p", type=float, default=0.6, help="the remembered per-token acceptance to start from")
    args = ap.parse_args()
    accel.maybe_reexec()

    from dflash.engine.generate import Finished, format_stats, stream_dflash_generate
    from dflash.engine.loading import load_pair
    from dflash.engine.prompting import build_prompt
    from dflash.engine.window import WindowMemory

    pair = load_pair(args.model, args.draft, dtype="float32")
    ids = build_prompt(pair.tokenizer, args.prompt)
    memory = WindowMemory(d=0.37, d_short=args.d_short, p=args.p)
    for run in range(args.runs):
        start = {k: round(v, 2) for k, v in vars(memory).items() if v is not None}
        for event in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, args.max_tokens,
                                            window_memory=memory):
            if isinstance(event, Finished):
                print(f"run {run + 1} from {start}\n  {format_stats(event.stats.to_dict())}", flush=True)


if __name__ == "__main__":
    main()
