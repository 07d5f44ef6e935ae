"""Every draft folder in the repository holds the weights its index names, committed and whole.

Session 49 committed soup47 as benchmark/training/campaign/session49/draft/ with its config,
trainer state and shard index, but not the three weight files the index names: they existed only
in that machine's working tree, and were lost with it. The next session's plan staged that folder
as its start draft. These checks read git's index (what a clean clone gets), not the working tree,
so a weight file present here but never added fails them.

Older campaign records keep a checkpoint's small files without weights on purpose (the index
names shards nobody committed, in folders named checkpoint/ or *-record/); a folder that a plan
stages or the engine loads (engine/drafts/*, any */draft/) must hold every shard.
"""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"


def _committed_files() -> set[str]:
    """Paths git tracks (a clean clone's files); the working tree when this is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        return {p for p in out.stdout.decode().split("\0") if p}
    except (OSError, subprocess.CalledProcessError):
        return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts}


COMMITTED = _committed_files()
INDEXES = sorted(p for p in COMMITTED if p.endswith("/" + INDEX))


def _must_hold_weights(folder: str) -> bool:
    return folder.startswith("engine/drafts/") or folder.endswith("/draft")


def _shards(index_path: str) -> dict[str, set[str]]:
    weight_map = json.loads((ROOT / index_path).read_text())["weight_map"]
    shards: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, set()).add(tensor)
    return shards


def test_the_bundled_draft_is_found():
    assert "engine/drafts/SmolLM2-135M-Instruct-DFlash/" + INDEX in INDEXES


DRAFT_FOLDERS = sorted({p.rsplit("/", 1)[0] for p in COMMITTED
                        if p.endswith("/config.json") and _must_hold_weights(p.rsplit("/", 1)[0])})


@pytest.mark.parametrize("folder", DRAFT_FOLDERS)
def test_a_draft_folder_has_weights_indexed_or_not(folder: str):
    """A draft folder with one unindexed model.safetensors, or none and no index either."""
    weights = [p for p in COMMITTED if p.startswith(folder + "/") and p.endswith(".safetensors")]
    assert weights, f"{folder} holds a config.json but git holds no .safetensors there"


@pytest.mark.parametrize("index_path", INDEXES)
def test_a_draft_folder_holds_every_shard_or_is_a_record(index_path: str):
    folder = index_path.rsplit("/", 1)[0]
    shards = _shards(index_path)
    held = {s for s in shards if f"{folder}/{s}" in COMMITTED}
    if _must_hold_weights(folder):
        assert held == set(shards), (
            f"{folder} is a draft folder, but git holds only {sorted(held)} of the shards its index "
            f"names {sorted(shards)}: `git add` the weights (or name the folder *-record/)")
    else:
        assert held in (set(), set(shards)), f"{folder} holds a part of its shards: {sorted(held)}"


@pytest.mark.parametrize("index_path", [p for p in INDEXES if _must_hold_weights(p.rsplit("/", 1)[0])])
def test_each_shard_is_whole_and_holds_the_tensors_its_index_names(index_path: str):
    folder = ROOT / index_path.rsplit("/", 1)[0]
    for shard, tensors in _shards(index_path).items():
        raw = (folder / shard).read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + header_len])
        header.pop("__metadata__", None)
        assert set(header) == tensors, f"{shard}: tensors differ from the index's"
        end = max(t["data_offsets"][1] for t in header.values())
        assert 8 + header_len + end == len(raw), f"{shard}: {len(raw)} bytes, its header says {8 + header_len + end}"
