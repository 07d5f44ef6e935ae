"""The campaign's data cache comes home as a delta over the staged cache (scripts/h200_pair.sh
packdata / unpack), so a device call that ends early loses only a small pack, not the fresh
answers at the tail of a 300 MB one (session 49). Real files, the real script, real xz."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "h200_pair.sh"

pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")


def _run(cmd: str, train: Path, stage: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, CAMPAIGN_TRAIN=str(train), CAMPAIGN_STAGE=str(stage), OUT=str(out), **env)
    return subprocess.run(["bash", str(SCRIPT), cmd], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=120)


def _files(data: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data.iterdir()) if p.name != ".unpacked"}


def _stage(stage: Path, *outs: Path) -> None:
    stage.mkdir(parents=True, exist_ok=True)
    for out in outs:
        for part in out.iterdir():
            shutil.copy(part, stage / part.name)


@pytest.fixture
def base(tmp_path: Path) -> tuple[Path, Path]:
    """A cache packed whole (no staged base: the old full pack), staged in a fresh folder."""
    train = tmp_path / "train0"
    (train / "data").mkdir(parents=True)
    (train / "data" / "responses.jsonl").write_text("".join(f'{{"r": {i}}}\n' for i in range(2000)))
    (train / "data" / "derived_prompts.jsonl").write_text('{"prompt": "a"}\n' * 500)
    (train / "data" / "shrinks.jsonl").write_text("x" * 5000)
    out = tmp_path / "out0"
    out.mkdir()
    r = _run("packdata", train, tmp_path / "nostage", out)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["campaign-data.tar.xz.00"]
    stage = tmp_path / "stage"
    _stage(stage, out)
    return train, stage


def test_delta_carries_only_changes_and_rebuilds_the_cache(tmp_path: Path, base) -> None:
    train0, stage = base
    train = tmp_path / "train1"
    r = _run("unpack", train, stage, tmp_path)
    assert r.returncode == 0, r.stderr
    assert _files(train / "data") == _files(train0 / "data")
    # the session's work: answers appended, a new prompts shard, a file rewritten shorter
    with (train / "data" / "responses.jsonl").open("a") as f:
        f.write("".join(f'{{"r": "new {i}"}}\n' for i in range(30)))
    (train / "data" / "derived_prompts.0of2.jsonl").write_text('{"prompt": "b"}\n' * 7)
    (train / "data" / "shrinks.jsonl").write_text("y" * 10)
    out = tmp_path / "out1"
    out.mkdir()
    r = _run("packdata", train, stage, out)
    assert r.returncode == 0, r.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert len(parts) == 1 and parts[0].startswith("campaign-delta-"), parts
    listed = r.stdout
    size = len((train0 / "data" / "responses.jsonl").read_bytes())
    assert f"data/responses.jsonl.from-{size}" in listed  # the new bytes only
    assert "data/derived_prompts.0of2.jsonl" in listed and "data/shrinks.jsonl" in listed
    assert "data/derived_prompts.jsonl" not in listed  # unchanged: left out
    assert (out / parts[0]).stat().st_size < (stage / "campaign-data.tar.xz.00").stat().st_size
    # the next session stages the base and the delta: unpack rebuilds the cache byte for byte
    stage2 = tmp_path / "stage2"
    _stage(stage2, stage, out)
    train2 = tmp_path / "train2"
    r = _run("unpack", train2, stage2, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "applied campaign-delta-" in r.stdout
    assert _files(train2 / "data") == _files(train / "data")
    # and a later delta is taken against everything staged (base + delta), not the base alone
    with (train2 / "data" / "responses.jsonl").open("a") as f:
        f.write('{"r": "later"}\n')
    out2 = tmp_path / "out2"
    out2.mkdir()
    r = _run("packdata", train2, stage2, out2)
    assert r.returncode == 0, r.stderr
    grown = len((train / "data" / "responses.jsonl").read_bytes())
    assert f"data/responses.jsonl.from-{grown}" in r.stdout
    assert "derived_prompts.0of2" not in r.stdout


def test_nothing_changed_packs_nothing(tmp_path: Path, base) -> None:
    _, stage = base
    train = tmp_path / "train1"
    assert _run("unpack", train, stage, tmp_path).returncode == 0
    out = tmp_path / "out1"
    out.mkdir()
    r = _run("packdata", train, stage, out)
    assert r.returncode == 0, r.stderr
    assert "nothing changed" in r.stdout and not list(out.iterdir())


def test_a_delta_over_the_wrong_base_is_refused(tmp_path: Path, base) -> None:
    train0, stage = base
    train = tmp_path / "train1"
    assert _run("unpack", train, stage, tmp_path).returncode == 0
    with (train / "data" / "responses.jsonl").open("a") as f:
        f.write('{"r": "new"}\n')
    out = tmp_path / "out1"
    out.mkdir()
    assert _run("packdata", train, stage, out).returncode == 0
    # staged over a different base (one line more): the delta does not fit, and says so
    with (train0 / "data" / "responses.jsonl").open("a") as f:
        f.write('{"r": "other"}\n')
    other = tmp_path / "other"
    other.mkdir()
    assert _run("packdata", train0, tmp_path / "nostage", other).returncode == 0
    stage2 = tmp_path / "stage2"
    _stage(stage2, other, out)
    train2 = tmp_path / "train2"
    r = _run("unpack", train2, stage2, tmp_path)
    assert r.returncode != 0
    assert "continues data/responses.jsonl from byte" in r.stdout
    assert not (train2 / "data" / ".unpacked").exists()  # a later call tries again, not half done
