"""scripts/label_agreement.py: the share of answer tokens that are the target's own greedy choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/label_agreement.py"


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt):]


def test_greedy_answers_agree_and_random_ones_do_not(tiny_dirs, tmp_path):
    d = tiny_dirs["llama"]
    model, _ = load(str(d))
    mod = load_script("label_agreement")
    prompts = [[1, 5, 9, 13], [1, 7, 2, 40, 41]]
    greedy = [{"prompt_ids": p, "response_ids": _greedy(model, p, 20), "temperature": 0.0} for p in prompts]
    n, share, first16 = mod.agreement(model, greedy, 256)
    assert n == 40 and share == 1.0 and first16 == 1.0
    vocab = model.args.vocab_size
    noise = [{"prompt_ids": p, "response_ids": [(7 * i + 3) % vocab for i in range(20)], "temperature": 0.7}
             for p in prompts]
    n, share, _ = mod.agreement(model, noise, 10)
    assert n == 20 and share < 0.5

    data = tmp_path / "responses.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in greedy + noise))
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(d), "--responses", str(data)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("temperature 0.0: 2 answers, 40 tokens") and "argmax 1.000" in lines[0]
    assert lines[1].startswith("temperature 0.7: 2 answers, 40 tokens")
