"""Draft checkpoint format, fit checks and the offline registry."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from dflash.engine import registry
from dflash.engine.draft import DFlashDraft, load_draft, quantize_draft, save_draft
from dflash.engine.drafters import DFlashDrafter
from dflash.engine.target import default_layer_ids
from helpers import cut_at_eos, greedy_reference, run_dflash


def test_published_layer_id_rule():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]


def test_checkpoint_names_and_roundtrip(tiny_dirs, tmp_path):
    d = tiny_dirs["qwen3"] / "draft"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    names = set(mx.load(str(d / "model.safetensors")))
    for n in ["fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.self_attn.k_norm.weight", "layers.0.input_layernorm.weight",
              "layers.0.post_attention_layernorm.weight", "layers.0.mlp.down_proj.weight"]:
        assert n in names
    assert not any(n.startswith(("embed", "lm_head")) for n in names)
    m = load_draft(d)
    save_draft(m, tmp_path / "copy")
    m2 = load_draft(tmp_path / "copy")
    x = mx.random.normal((1, 16, m.config.hidden_size))
    assert mx.array_equal(m(x, 0), m2(x, 0))


def test_quantized_draft_saves_loads_and_stays_lossless(pairs, tmp_path):
    pair = pairs("qwen3")
    draft = load_draft(pair.draft_path)
    quantize_draft(draft, bits=4, group_size=32)
    save_draft(draft, tmp_path / "q4")
    q = load_draft(tmp_path / "q4")
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]["bits"] == 4
    ids = pair.tokenizer.encode("The quick brown fox")
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, DFlashDrafter(q, pair.target), pair.tokenizer, ids, 40)
    assert final.token_ids == ref


def test_draft_that_does_not_fit_is_refused(pairs, tmp_path):
    pair = pairs("qwen3")
    cfg = load_draft(pair.draft_path).config
    bad = DFlashDraft(type(cfg)(**{**cfg.__dict__, "hidden_size": 32, "target_layer_ids": [0, 99]}))
    with pytest.raises(ValueError, match="hidden size 32.*out of range"):
        DFlashDrafter(bad, pair.target)


def test_registry_resolves_offline(tmp_path, monkeypatch):
    with pytest.raises(registry.DraftNotFoundError, match="train-draft"):
        registry.resolve_draft("/models/SomethingUnknown-1B")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(registry.DraftNotFoundError, match="z-lab/Qwen3-8B-DFlash-b16"):
        registry.resolve_draft("mlx-community/Qwen3-8B-4bit")
    snap = tmp_path / "hub" / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert registry.resolve_draft("Qwen3-8B-bf16") == snap
    local = tmp_path / "drafts" / "MyModel-DFlash"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert registry.resolve_draft("/x/MyModel", search_dirs=[tmp_path / "drafts"]) == local


def test_missing_draft_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="dflash_config"):
        load_draft(tmp_path)
