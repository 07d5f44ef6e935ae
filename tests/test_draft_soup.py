"""scripts/draft_soup.py: the weighted mean of drafts' weights, a loadable draft, refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash.engine.training.checkpoint import load_draft_any, write_parts

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/draft_soup.py"


def _params(folder: Path) -> dict[str, mx.array]:
    return dict(tree_flatten(load_draft_any(folder).parameters()))


def _shifted(src: Path, dst: Path, by: float) -> None:
    """A copy of the draft at src with every weight moved by `by` (another point on a 'line')."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    write_parts({k: v + by for k, v in _params(src).items()}, dst)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_soup_is_the_weighted_mean_and_loads(tiny_dirs, tmp_path: Path) -> None:
    a = tiny_dirs["llama"] / "draft"
    b = tmp_path / "b"
    _shifted(a, b, 0.5)
    out = tmp_path / "soup"
    res = _run(str(out), str(a), str(b), "--weights", "3,1")  # normalised: 0.75, 0.25
    assert res.returncode == 0, res.stderr
    pa, pb, ps = _params(a), _params(b), _params(out)
    assert set(ps) == set(pa)
    for name, v in ps.items():
        want = 0.75 * pa[name].astype(mx.float32) + 0.25 * pb[name].astype(mx.float32)
        assert v.dtype == pa[name].dtype
        assert mx.allclose(v.astype(mx.float32), want, atol=1e-5).item(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    sources = json.loads((out / "soup.json").read_text())["soup"]
    assert [s["weight"] for s in sources] == [0.75, 0.25]
    assert not (out / "trainer.json").exists()  # no step to resume from
    # equal weights by default
    res = _run(str(tmp_path / "even"), str(a), str(b))
    assert res.returncode == 0, res.stderr
    name = next(iter(pa))
    assert mx.allclose(_params(tmp_path / "even")[name], (pa[name] + pb[name]) / 2, atol=1e-5).item()
    # a negative weight extrapolates along the line: -1,2 lands as far past b as b is from a
    res = _run(str(tmp_path / "past"), str(a), str(b), "--weights=-1,2")
    assert res.returncode == 0, res.stderr
    assert mx.allclose(_params(tmp_path / "past")[name].astype(mx.float32),
                       pb[name].astype(mx.float32) + 0.5, atol=1e-2).item()


def test_soup_refuses_drafts_of_other_shapes_and_bad_weights(tiny_dirs, tmp_path: Path) -> None:
    a = tiny_dirs["llama"] / "draft"
    other = tiny_dirs["qwen3"] / "draft"
    res = _run(str(tmp_path / "x"), str(a), str(other))
    assert res.returncode == 2 and "config.json differ" in res.stderr
    assert not (tmp_path / "x").exists()
    res = _run(str(tmp_path / "y"), str(a), str(a), "--weights", "0.3,-0.3")
    assert res.returncode == 2 and "sum to more than 0" in res.stderr
    res = _run(str(tmp_path / "w"), str(a), str(a), "--weights", "1,two")
    assert res.returncode == 2 and "numbers separated by commas" in res.stderr
    assert "Traceback" not in res.stderr
    res = _run(str(tmp_path / "z"), str(a))
    assert res.returncode == 2 and "two or more drafts" in res.stderr
    res = _run(str(a), str(a), str(a))  # never writes over an existing folder
    assert res.returncode == 2 and "exists" in res.stderr


def test_a_soup_given_a_campaign_resumes_it(tmp_path: Path) -> None:
    """--campaign DRAFT: the soup takes that checkpoint's trainer.json (not its moments), and
    train-draft --resume continues the campaign from the soup's weights at that step (session 40
    copied session 35's trainer.json beside soup B by hand)."""
    from dflash.engine.tiny import build_target
    from dflash.engine.training import TrainOptions, train_draft

    target = build_target(tmp_path / "target", "qwen3")
    common = dict(target=str(target), data_dir=str(tmp_path / "data"), layers=1, block_size=8,
                  num_capture=3, seqs_per_batch=2, anchors_per_seq=4, max_len=64, num_prompts=6,
                  max_new_tokens=16, gen_batch_size=6, eval_prompts=0, log_every=1, ckpt_every=0,
                  dtype="float32", compile=False)
    train_draft(TrainOptions(out=str(tmp_path / "run"), total_steps=4, **common), log=lambda s: None)
    ckpt = tmp_path / "run" / "checkpoint"
    other = tmp_path / "other"
    _shifted(ckpt, other, 0.01)
    soup = tmp_path / "soup"
    res = _run(str(soup), str(ckpt), str(other), "--campaign", str(ckpt))
    assert res.returncode == 0, res.stderr
    trainer = json.loads((soup / "trainer.json").read_text())
    before = json.loads((ckpt / "trainer.json").read_text())
    assert trainer["step"] == before["step"] == 4 and trainer["schedule"] == before["schedule"]
    assert trainer["optimizer_saved"] is False and not (soup / "optimizer").exists()
    assert json.loads((soup / "soup.json").read_text())["campaign"] == str(ckpt)
    lines: list[str] = []
    train_draft(TrainOptions(out=str(tmp_path / "more"), resume=str(soup), total_steps=6, **common),
                log=lines.append)
    assert any(f"resumed from {soup} at step 4" in ln for ln in lines), lines
    assert json.loads((tmp_path / "more" / "checkpoint" / "trainer.json").read_text())["step"] == 6
    # a folder without trainer.json is refused in one line, before anything is written
    res = _run(str(tmp_path / "nope"), str(ckpt), str(other), "--campaign", str(other))
    assert res.returncode == 2 and "no trainer.json" in res.stderr and not (tmp_path / "nope").exists()
