"""Shared fixtures: tiny random-weight targets of every supported family, built once per run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.engine import tiny

ARCHS = list(tiny.ARCH_CONFIGS)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch -> model directory (target) with a 1-layer random draft in <dir>/draft."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        d = root / arch
        tiny.build_target(d, arch)
        tiny.build_draft(d / "draft", d)
        out[arch] = d
    return out


@pytest.fixture(scope="session")
def pairs(tiny_dirs):
    """arch -> loaded Pair (target, drafter, tokenizer), loaded lazily and kept for the run."""
    from dflash.engine.loading import load_pair

    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")
        return cache[arch]

    return get
