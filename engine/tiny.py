"""Tiny random-weight targets and drafts, built offline from config dicts, for tests and demos.

Each target is a real mlx-lm model directory (config.json, model.safetensors, tokenizer files)
that `mlx_lm.load` opens like any downloaded model. The tokenizer is a real byte-level BPE
trained here on a small built-in text, with a chat template and a mask token for the draft.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .draft import DFlashDraft, DraftConfig, save_draft
from .target import default_layer_ids

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
Speculative decoding lets a small model propose tokens that a large model checks in one pass.
Every emitted token is the large model's own greedy choice, so the output does not change.
The draft proposes a block of sixteen tokens; the target verifies the block and keeps the
longest prefix it agrees with, plus one token of its own. Caches roll back what was rejected.
Once upon a time there was a small town by the sea where fishermen mended their nets at dawn.
def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Question: what is the capital of France? Answer: Paris is the capital of France.
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 200 300 1000 2026
"""

# Tiny shapes: hidden 64, head_dim 64 (so quantized KV groups fit), a handful of layers.
_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)

# Gated DeltaNet hybrids: linear-attention layers with a full-attention layer every 2nd.
_HYBRID = dict(
    num_hidden_layers=4,
    full_attention_interval=2,
    linear_num_value_heads=2,
    linear_num_key_heads=1,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [8, 8, 0],
    },
)

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_BASE, model_type="llama", num_hidden_layers=4, tie_word_embeddings=False),
    "qwen3": dict(_BASE, model_type="qwen3", num_hidden_layers=4),
    "qwen3_moe": dict(
        _BASE,
        model_type="qwen3_moe",
        num_hidden_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    "qwen3_5": dict(_BASE, model_type="qwen3_5", **_HYBRID),
    "qwen3_5_moe": dict(
        _BASE,
        model_type="qwen3_5_moe",
        **_HYBRID,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    "gemma3_text": dict(
        _BASE,
        model_type="gemma3_text",
        num_hidden_layers=4,
        sliding_window=24,
        sliding_window_pattern=2,
        query_pre_attn_scalar=64,
        rope_local_base_freq=10000.0,
        rope_global_base_freq=10000.0,
        final_logit_softcapping=None,
    ),
}


def build_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE on the built-in text and save it as a HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def build_target(path: str | Path, arch: str = "qwen3", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight mlx-lm model of family `arch` (fp32) with a real tokenizer."""
    from mlx_lm.utils import _get_classes

    if arch not in ARCH_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(ARCH_CONFIGS)}")
    path = Path(path)
    build_tokenizer(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = dict(ARCH_CONFIGS[arch], vocab_size=len(vocab) + len(SPECIAL_TOKENS), **overrides)
    config["eos_token_id"] = _token_id(path, "<|im_end|>")
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Default init leaves the residual stream dominated by the embedding, so random models
    # repeat one token; larger projection weights give varied, decisive greedy output.
    model.load_weights(
        [(k, v * 3.0 if _is_projection(k, v) else v) for k, v in tree_flatten(model.parameters())]
    )
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _is_projection(name: str, v: mx.array) -> bool:
    skip = ("embed_tokens", "lm_head", "conv1d", "norm")
    return v.ndim >= 2 and not any(s in name for s in skip)


def _token_id(path: Path, token: str) -> int:
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(token)
    if tid is None:
        raise ValueError(f"tokenizer lacks {token}")
    return tid


def build_draft(
    path: str | Path,
    target_path: str | Path,
    num_layers: int = 1,
    block_size: int = 16,
    layer_ids: list[int] | None = None,
    seed: int = 1,
) -> Path:
    """Write a random-weight DFlash draft that fits the tiny target at target_path."""
    target_cfg = json.loads((Path(target_path) / "config.json").read_text())
    n_target = target_cfg["num_hidden_layers"]
    cfg = DraftConfig(
        hidden_size=target_cfg["hidden_size"],
        num_hidden_layers=num_layers,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=target_cfg["vocab_size"],
        target_layer_ids=layer_ids or default_layer_ids(n_target, min(3, n_target)),
        mask_token_id=_token_id(Path(target_path), "<|mask|>"),
        block_size=block_size,
        rope_theta=10000.0,
        num_target_layers=n_target,
        max_position_embeddings=target_cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(target_cfg.get("tie_word_embeddings", False)),
    )
    mx.random.seed(seed)
    save_draft(DFlashDraft(cfg), path)
    return Path(path)
