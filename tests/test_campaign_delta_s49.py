"""The campaign's data cache comes home as a delta over the staged cache (scripts/h200_pair.sh
packdata / unpack, through scripts/campaign_data.py), so a device call that ends early loses
only a small pack, not the fresh answers at the tail of a 300 MB one (session 49). Real files,
the real scripts, real xz parts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "h200_pair.sh"

pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz (the whole-cache pack)")


def _run(cmd: str, train: Path, stage: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CAMPAIGN_TRAIN=str(train), CAMPAIGN_STAGE=str(stage), OUT=str(out),
               CAMPAIGN_LOG=str(train.parent / f"{train.name}.log"))
    return subprocess.run(["bash", str(SCRIPT), cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _files(data: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data.iterdir()) if not p.name.startswith(".")}


def _stage(stage: Path, *outs: Path) -> Path:
    stage.mkdir(parents=True, exist_ok=True)
    for out in outs:
        for part in out.iterdir():
            shutil.copy(part, stage / part.name)
    return stage


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def _pack(train: Path, stage: Path, out: Path) -> subprocess.CompletedProcess:
    out.mkdir()
    r = _run("packdata", train, stage, out)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture
def base(tmp_path: Path) -> tuple[Path, Path]:
    """A cache packed whole (nothing staged: the full pack), staged in a fresh folder."""
    train = tmp_path / "train0"
    (train / "data").mkdir(parents=True)
    (train / "data" / "responses.jsonl").write_text("".join(f'{{"r": {i}}}\n' for i in range(2000)))
    (train / "data" / "derived_prompts.jsonl").write_text('{"prompt": "a"}\n' * 500)
    (train / "data" / "shrinks.jsonl").write_text("x" * 5000 + "\n")
    _pack(train, tmp_path / "nostage", tmp_path / "out0")
    assert sorted(p.name for p in (tmp_path / "out0").iterdir()) == ["campaign-data.tar.xz.00"]
    return train, _stage(tmp_path / "stage", tmp_path / "out0")


def _unpack(train: Path, stage: Path) -> subprocess.CompletedProcess:
    r = _run("unpack", train, stage, train.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _session(tmp_path: Path, stage: Path, line: str) -> Path:
    """A session's cache: `stage` unpacked, `line` answered, the delta packed into out1."""
    train = tmp_path / "train1"
    _unpack(train, stage)
    _append(train / "data" / "responses.jsonl", line)
    _pack(train, stage, tmp_path / "out1")
    return train


def test_a_delta_carries_only_new_lines_and_rebuilds_the_cache(tmp_path: Path, base) -> None:
    train0, stage = base
    train = tmp_path / "train1"
    _unpack(train, stage)
    assert _files(train / "data") == _files(train0 / "data")
    # the session's work: answers appended (the last line still being written), a new prompts
    # shard, a file rewritten shorter
    size = (train / "data" / "responses.jsonl").stat().st_size
    _append(train / "data" / "responses.jsonl", "".join(f'{{"r": "new {i}"}}\n' for i in range(30)) + '{"r": "hal')
    (train / "data" / "derived_prompts.0of2.jsonl").write_text('{"prompt": "b"}\n' * 7)
    (train / "data" / "shrinks.jsonl").write_text("y\n")
    r = _pack(train, stage, tmp_path / "out1")
    parts = sorted(p.name for p in (tmp_path / "out1").iterdir())
    assert len(parts) == 1 and parts[0].startswith("campaign-delta-"), parts
    new_lines = "".join(f'{{"r": "new {i}"}}\n' for i in range(30)).encode()
    assert f"data/responses.jsonl.from-{size} {len(new_lines)}" in r.stdout  # whole lines, the new ones only
    assert "data/derived_prompts.0of2.jsonl" in r.stdout and "data/shrinks.jsonl 2" in r.stdout
    assert "data/derived_prompts.jsonl " not in r.stdout  # unchanged: left out
    # the next session stages the base and the delta: unpack rebuilds the cache
    train2 = tmp_path / "train2"
    r = _unpack(train2, _stage(tmp_path / "stage2", stage, tmp_path / "out1"))
    assert "applied campaign-delta-" in r.stdout
    want = _files(train / "data")
    want["responses.jsonl"] = want["responses.jsonl"][: want["responses.jsonl"].rfind(b"\n") + 1]
    assert _files(train2 / "data") == want
    # a later delta continues from everything staged (base and delta), not from the base
    _append(train2 / "data" / "responses.jsonl", '{"r": "later"}\n')
    grown = len(want["responses.jsonl"])
    r = _pack(train2, tmp_path / "stage2", tmp_path / "out2")
    assert f"data/responses.jsonl.from-{grown} 15" in r.stdout and "derived_prompts.0of2" not in r.stdout


def test_two_deltas_of_one_session_overlap_and_both_apply(tmp_path: Path, base) -> None:
    """Both deltas of a session start at the staged size (a phase packed twice): the overlap is
    checked and only the rest appended (the second used to be refused, losing its lines)."""
    _, stage = base
    train = _session(tmp_path, stage, '{"r": "first"}\n')
    _append(train / "data" / "responses.jsonl", '{"r": "second"}\n')
    _pack(train, stage, tmp_path / "out2")
    later = tmp_path / "train2"
    r = _unpack(later, _stage(tmp_path / "stage2", stage, tmp_path / "out1", tmp_path / "out2"))
    assert r.stdout.count("applied campaign-delta-") == 2, r.stdout
    assert _files(later / "data") == _files(train / "data")


def test_nothing_changed_packs_nothing(tmp_path: Path, base) -> None:
    _, stage = base
    train = tmp_path / "train1"
    _unpack(train, stage)
    r = _pack(train, stage, tmp_path / "out1")
    assert "nothing changed" in r.stdout and not list((tmp_path / "out1").iterdir())


def test_a_delta_over_another_base_or_cut_short_is_skipped(tmp_path: Path, base) -> None:
    train0, stage = base
    train = _session(tmp_path, stage, '{"r": "new"}\n')
    # a newer base (one more line) with the old delta still staged beside it: not applied over it
    _append(train0 / "data" / "responses.jsonl", '{"r": "other"}\n')
    _pack(train0, tmp_path / "nostage", tmp_path / "other")
    train2 = tmp_path / "train2"
    r = _unpack(train2, _stage(tmp_path / "stage2", tmp_path / "other", tmp_path / "out1"))
    assert "skipped campaign-delta-" in r.stdout and "another base" in r.stdout, r.stdout
    assert _files(train2 / "data") == _files(train0 / "data")
    # a delta whose call ended mid-pack (its part cut short): skipped, the cache still made
    stage3 = _stage(tmp_path / "stage3", stage)
    (part,) = (tmp_path / "out1").iterdir()
    (stage3 / part.name).write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    train3 = tmp_path / "train3"
    r = _unpack(train3, stage3)
    assert "cut short or damaged" in r.stdout, r.stdout
    assert _files(train3 / "data") == {k: v for k, v in _files(train / "data").items()
                                       if k != "responses.jsonl"} | {"responses.jsonl": _files(train0 / "data")[
                                           "responses.jsonl"][: -len(b'{"r": "other"}\n')]}


def test_a_base_that_cannot_be_read_stops_the_job_and_leaves_no_cache(tmp_path: Path, base) -> None:
    _, stage = base
    (part,) = stage.iterdir()
    part.write_bytes(part.read_bytes()[:500])
    train = tmp_path / "train1"
    r = _run("unpack", train, stage, tmp_path)
    assert r.returncode == 1
    assert "cannot be read" in r.stderr and "no job started" in r.stdout
    assert not (train / "data").exists()  # nothing half-built for a job to write into
    log = (tmp_path / "train1.log").read_text()
    assert "TRAIN_DONE rc=1" in log  # what h200_session.sh's failure guard reads
    fails = subprocess.run(["bash", str(SCRIPT), "failed", str(tmp_path / "train1.log")], cwd=ROOT)
    assert fails.returncode == 0
