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


# --- interchangeable with the published drafts and with dflash-mlx ------------------------------
# The shape of a published z-lab config.json (Qwen3-4B-DFlash-b16), sizes scaled down to the tiny
# qwen3 target; every key is as published, including the ones only transformers reads.
def _published_config(target_cfg: dict, layer_ids: list[int] = (0, 1)) -> dict:
    n = 2
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": target_cfg["vocab_size"] - 1, "target_layer_ids": list(layer_ids)},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": target_cfg["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": ["full_attention"] * n,
        "max_position_embeddings": 40960,
        "max_window_layers": n,
        "model_type": "qwen3",
        "num_attention_heads": 2,
        "num_hidden_layers": n,
        "num_key_value_heads": 1,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": target_cfg["vocab_size"],
    }


# What dflash-mlx's DFlashDraftModelArgs requires (no defaults there), read by its loader.
DFLASH_MLX_REQUIRED = [
    "model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
    "rms_norm_eps", "vocab_size", "num_key_value_heads", "max_position_embeddings", "rope_theta",
    "head_dim", "tie_word_embeddings", "num_target_layers", "block_size",
]
TOOLING_ONLY = {"auto_map", "transformers_version", "bos_token_id", "eos_token_id"}


def test_a_published_draft_loads_and_runs(tiny_dirs, pairs, tmp_path):
    from dflash.engine.draft import DraftConfig

    target_cfg = json.loads((tiny_dirs["qwen3"] / "config.json").read_text())
    pair = pairs("qwen3")
    layer_ids = pair.target.layer_ids  # the captured layers of the loaded pair
    published = _published_config(target_cfg, layer_ids)
    model = DFlashDraft(DraftConfig.from_dict(published))
    from mlx.utils import tree_flatten

    d = tmp_path / "published"
    d.mkdir()
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(published, indent=2))
    draft = load_draft(d)
    c = draft.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, target_cfg["vocab_size"] - 1, layer_ids)
    assert (c.num_target_layers, c.max_position_embeddings, c.tie_word_embeddings) == (
        target_cfg["num_hidden_layers"], 40960, True)
    ids = pair.tokenizer.encode("The quick brown fox")
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 24), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, DFlashDrafter(draft, pair.target), pair.tokenizer, ids, 24)
    assert final.token_ids == ref
    # saved again by us: every published key is still there with its value (tooling keys too),
    # except dtype, which says what the weights are (these random ones are float32)
    save_draft(draft, tmp_path / "resaved")
    again = json.loads((tmp_path / "resaved" / "config.json").read_text())
    for k, v in published.items():
        assert again[k] == (v if k != "dtype" else "float32"), k


def test_our_config_has_every_published_key(tiny_dirs, tmp_path):
    target_cfg = json.loads((tiny_dirs["qwen3"] / "config.json").read_text())
    ours = json.loads((tiny_dirs["qwen3"] / "draft" / "config.json").read_text())
    published = _published_config(target_cfg)
    assert set(published) - TOOLING_ONLY <= set(ours)
    for k in DFLASH_MLX_REQUIRED:
        assert ours[k] is not None, k
    assert ours["architectures"] == ["DFlashDraftModel"] and ours["model_type"] == "qwen3"
    assert ours["num_target_layers"] == target_cfg["num_hidden_layers"]
    assert ours["max_position_embeddings"] == target_cfg["max_position_embeddings"]
    assert ours["tie_word_embeddings"] == bool(target_cfg.get("tie_word_embeddings", False))
    assert ours["layer_types"] == ["full_attention"] * ours["num_hidden_layers"]
    assert ours["max_window_layers"] == ours["num_hidden_layers"]
    assert ours["dtype"] == "float32" and ours["rope_scaling"] is None
    assert ours["attention_bias"] is False and ours["use_sliding_window"] is False
    assert 0 <= ours["dflash_config"]["mask_token_id"] < ours["vocab_size"]
    assert all(0 <= i < ours["num_target_layers"] for i in ours["dflash_config"]["target_layer_ids"])
    names = set(mx.load(str(tiny_dirs["qwen3"] / "draft" / "model.safetensors")))
    assert not any(n.startswith(("lm_head", "embed_tokens", "model.")) for n in names)


def test_save_load_save_is_stable(tiny_dirs, tmp_path):
    src = tiny_dirs["qwen3"] / "draft"
    save_draft(load_draft(src), tmp_path / "a")
    save_draft(load_draft(tmp_path / "a"), tmp_path / "b")
    a, b = (json.loads((tmp_path / x / "config.json").read_text()) for x in "ab")
    assert a == b == json.loads((src / "config.json").read_text())
    wa, wb = (mx.load(str(tmp_path / x / "model.safetensors")) for x in "ab")
    assert set(wa) == set(wb) and all(mx.array_equal(wa[k], wb[k]) for k in wa)


def test_what_our_draft_cannot_run_is_refused_clearly(tiny_dirs, tmp_path):
    from dflash.engine.draft import DraftConfig

    target_cfg = json.loads((tiny_dirs["qwen3"] / "config.json").read_text())
    for change, msg in [({"attention_bias": True}, "attention_bias"),
                        ({"layer_types": ["sliding_attention", "full_attention"],
                          "sliding_window": 64}, "sliding_attention"),
                        ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1"),
                        ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer >= 1")]:
        with pytest.raises(ValueError, match=msg):
            DraftConfig.from_dict({**_published_config(target_cfg), **change})
    draft = load_draft(tiny_dirs["qwen3"] / "draft")
    draft.lm_head = mx.zeros((4, 4))  # a draft must never carry its own head
    with pytest.raises(ValueError, match="lm_head"):
        save_draft(draft, tmp_path / "bad")


def test_bf16_draft_computes_in_float32_beside_a_float32_target(pairs, tiny_dirs, tmp_path):
    """A bf16 draft next to an fp32 target is cast up (every path runs the pair as `make demo`'s
    --dtype float32 does); an explicit dtype wins, and a target not in fp32 leaves it as stored."""
    from dflash.engine.loading import draft_dtype, load_pair

    d = load_draft(tiny_dirs["qwen3"] / "draft")
    d.set_dtype(mx.bfloat16)
    save_draft(d, tmp_path / "bf16")
    assert load_draft(tmp_path / "bf16").fc.weight.dtype == mx.bfloat16
    target = tiny_dirs["qwen3"]
    assert load_pair(target, tmp_path / "bf16").drafter.draft.fc.weight.dtype == mx.float32
    assert load_pair(target, tmp_path / "bf16", dtype="bfloat16").drafter.draft.fc.weight.dtype == mx.bfloat16
    model = pairs("qwen3").target.model
    assert draft_dtype(model, None) == mx.float32
    assert draft_dtype(model, "float16") == mx.float16
    half = load_pair(target, tmp_path / "bf16", dtype="float16").target.model
    assert draft_dtype(half, None) is None


def test_snapshot_identity_names_the_draft_dtype_it_computes_in(tiny_dirs, tmp_path):
    """Prefix snapshots hold the draft's context K/V: a draft cast up beside an fp32 target must
    not share snapshots with the same draft loaded in bf16."""
    from dflash.daemon.caching import pair_identity
    from dflash.engine.loading import load_pair

    d = load_draft(tiny_dirs["qwen3"] / "draft")
    d.set_dtype(mx.bfloat16)
    save_draft(d, tmp_path / "bf16")
    target = tiny_dirs["qwen3"]
    native = pair_identity(load_pair(target, tmp_path / "bf16"), None)
    bf16 = pair_identity(load_pair(target, tmp_path / "bf16", dtype="bfloat16"), "bfloat16")
    assert "|float32|" in native.draft and "|bfloat16|" in bf16.draft
    assert native.draft != bf16.draft
