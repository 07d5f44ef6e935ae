"""Settings that cannot work are refused where they are given, before a model or a job runs:
KV-cache bits MLX cannot quantize to, a cache process told to share the worker's endpoint, a
cache budget named by what is wrong with it, sparse prefill handed a prefix cache."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from daemon_fixtures import make_daemon, tiny_pair  # noqa: F401

from dflash.daemon.config import DaemonConfig
from dflash.engine import rollback
from dflash.engine.cli import main
from dflash.engine.generate import stream_dflash_generate


def test_kv_bits_mlx_cannot_take_are_refused_everywhere(pairs, tiny_dirs):
    assert rollback.kv_bits_problem(7) == "kv_bits must be one of 2, 3, 4, 5, 6, 8, got 7"
    assert all(rollback.kv_bits_problem(b) is None for b in (None, 0, *rollback.KV_BITS))
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match="kv_bits must be one of"):  # before any prefill
        next(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, "hi", 4, kv_bits=7))
    with pytest.raises(ValueError, match="got 7"):
        DaemonConfig(model="m", kv_bits=7).validate()
    model = tiny_dirs["qwen3"]
    res = CliRunner(env={"DFLASH_BLAS": "none"}).invoke(
        main, ["generate", "--model", str(model), "--draft", str(model / "draft"), "-p", "hi", "--kv-bits", "7"])
    assert res.exit_code == 2 and "kv_bits must be one of" in res.output, res.output


def test_cache_settings_are_named(tmp_path):
    ep = f"ipc://{tmp_path}/w.sock"
    with pytest.raises(ValueError, match="each need their own"):
        DaemonConfig(model="m", endpoint=ep, cache_endpoint=ep).validate()
    with pytest.raises(ValueError, match="l2_cache_gb must be > 0, got 0"):
        DaemonConfig(model="m", l2_cache_gb=0).validate()
    with pytest.raises(ValueError, match="cache_every must be >= 1, got 0"):
        DaemonConfig(model="m", cache_every=0).validate()
    DaemonConfig(model="m", endpoint=ep).validate()  # the default cache endpoint is its own


def test_sparse_prefill_refuses_a_prefix_cache(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("Once upon a time there was")
    with pytest.raises(ValueError, match="sparse prefill cannot be combined with prefix_cache"):
        next(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, "", 4, prefix_cache=object(),
                                    prompt_tokens_override=ids, prompt_token_positions=list(range(len(ids)))))


def test_a_prompt_over_the_frame_cap_is_too_large_not_no_worker(make_daemon):  # noqa: F811
    """The worker answers an oversized frame with `too_large` but cannot read its rid; the client
    must take that answer (its socket is its own) instead of re-sending until its timeout."""
    import asyncio
    import time

    from dflash.client import AsyncDFlashClient, BadRequestError, DFlashClient

    d = make_daemon(max_frame_bytes=4096)
    big = "a " * 5000  # ~10 KB of text: over the 4 KiB cap
    t0 = time.monotonic()
    with pytest.raises(BadRequestError, match="too_large"):
        DFlashClient(endpoint=d.endpoint, timeout=20).generate(big, max_tokens=2)
    with pytest.raises(BadRequestError, match="too_large"):
        asyncio.run(AsyncDFlashClient(endpoint=d.endpoint, timeout=20).generate(big, max_tokens=2))
    assert time.monotonic() - t0 < 10  # answered, not timed out twice
    assert DFlashClient(endpoint=d.endpoint, timeout=20).generate("hi", max_tokens=2).token_ids  # still serving
