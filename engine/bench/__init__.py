"""`dflash benchmark`: DFlash against mlx-lm's own decoding, side by side, in one process.

Why one process and this protocol: speed numbers from different processes, prompts or warm-up
states are not comparable. For every context length both engines get prompts of (about) that
length, the same max_tokens and the same sampling (greedy by default); warm-up runs come first (a
fresh process pays kernel compilation on its first calls), then timed runs alternate
baseline/DFlash with a cooldown sleep between them, and the summary takes medians (every run is
in the JSON too).

First-time lengths (default): every timed run decodes at (tokens, cache length) shapes this
process never ran before (plan.py): per-shape caches, such as MLX-CUDA's cuDNN attention
graphs, cannot flatter a run that re-decodes a visited length. Each run gets its own prompt
length, chosen near the nominal context; a ledger of every target forward checks it, run by run.
Losslessness is measured against a baseline run on the same prompt (untimed, after the timed ones).

`--oracle` swaps the draft for `OracleDrafter` replaying a baseline run's ids (every draft accepted):
the engine's ceiling, labelled as such everywhere. `--random-target SHAPE` builds a random-weight
target of a named shape in memory, for speed-only numbers on machines without weights.

The modules (engine/bench/, `dflash.engine.bench`; `python -m dflash.engine.bench` runs the
command, `python -m dflash.engine.bench.plot RESULT.json` draws a saved result again):

    cli.py          the `dflash benchmark` command and its option checks
    run.py          run_benchmark: checks, setup, every row, the JSON, table and plot; Ctrl-C, SIGTERM
    rows.py         one row: Bench, first-time / same-prompt runs, summarize
    timing.py       one timed run of each engine (one clock), compare_ids, time_forward
    plan.py         first-time cache lengths: the shape ledger and the planner
    setup.py        the config, the target / draft / tokenizer, drafters, prompts
    results.py      the result JSON: method, file name, results folder
    environment.py  hardware_info and versions (also written by scripts/)
    plot.py         the console table and the PNG plot (matplotlib optional)
"""
