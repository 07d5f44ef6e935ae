"""The DFlash draft model: a small non-causal transformer fed with the target's hidden states.

It has no embedding and no LM head of its own: block tokens are embedded with the target's
embedding, and its final `norm` output goes through the target's LM head. Context features (K
target layer outputs, concatenated) are projected once by `fc` + `hidden_norm`; in every layer
the block's queries attend to [context ; block] keys/values, both made by that layer's own
k_proj/v_proj. Only context K/V persist in the draft's cache; block K/V are dropped after the pass.

Checkpoint format (published DFlash drafts): config.json with block_size and
dflash_config {mask_token_id, target_layer_ids}; safetensors named fc.weight, hidden_norm.weight,
norm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.{input,post_attention}_layernorm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight.

Interchangeable with the published drafts and with dflash-mlx: `save_draft` writes every key of a
published config (architectures, model_type, block_size, dflash_config, num_target_layers,
max_position_embeddings, tie_word_embeddings, layer_types, rope_theta / rope_scaling, ...; see
PUBLISHED_DEFAULTS) and no embedding or lm_head weight (the draft borrows the target's; dflash-mlx
refuses a draft that brings its own lm_head). `load_draft` reads a published config as is and
refuses, with the reason, what this draft cannot run (attention biases, sliding-window layers).
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import verifyattn

if TYPE_CHECKING:
    from .fuse import Shared

# Keys of a published DFlash config.json (z-lab/Qwen3-*-DFlash-b16) that the draft's shape does not
# determine, with the published values; save_draft writes them unless the config carries its own.
PUBLISHED_DEFAULTS: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rope_scaling": None,
    "sliding_window": None,
    "use_cache": True,
    "use_sliding_window": False,
}


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    num_target_layers: int = 0
    model_type: str = "qwen3"
    max_position_embeddings: int = 32768  # the target's context length (RoPE scaling needs it)
    tie_word_embeddings: bool = False  # the target's; the draft has no lm_head either way
    rope_scaling: dict | None = None  # as in the target's config (e.g. llama3, yarn); None: plain
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftConfig":
        if not isinstance(d, dict) or "dflash_config" not in d:
            raise ValueError("not a DFlash draft: its config.json has no dflash_config")
        dc = d.get("dflash_config") or {}
        missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dc]
        if missing:
            raise ValueError(f"draft config.json lacks dflash_config.{', '.join(missing)}")
        rope_params = d.get("rope_parameters") or {}  # transformers v5 spelling
        rope = d.get("rope_theta") or rope_params.get("rope_theta") or 1e6
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        heads = d["num_attention_heads"]
        n_layers = d["num_hidden_layers"]
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"draft config.json: num_hidden_layers must be an integer >= 1, got {n_layers!r}")
        if not dc["target_layer_ids"]:
            raise ValueError("draft config.json: dflash_config.target_layer_ids is empty (the draft reads "
                             "no target layer)")
        ids, mask = dc["target_layer_ids"], dc["mask_token_id"]
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"draft config.json: dflash_config.target_layer_ids must be a list of layer "
                             f"numbers >= 0, got {ids!r}")
        if not _is_int(mask):
            raise ValueError(f"draft config.json: dflash_config.mask_token_id must be a token id, got {mask!r}")
        unsupported = []
        if d.get("attention_bias"):
            unsupported.append("attention_bias: true")
        kinds = set(d.get("layer_types") or ["full_attention"])
        if kinds - {"full_attention"}:
            unsupported.append(f"layer_types {sorted(kinds - {'full_attention'})}")
        if d.get("layer_types") and len(d["layer_types"]) != n_layers:
            unsupported.append(f"{len(d['layer_types'])} layer_types for {n_layers} layers")
        if unsupported:
            raise ValueError("this draft needs what dflash's draft model does not implement: "
                             + "; ".join(unsupported))
        known = {
            "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "block_size", "rms_norm_eps",
            "rope_theta", "num_target_layers", "model_type", "dflash_config", "architectures",
            "max_position_embeddings", "tie_word_embeddings", "rope_scaling", "layer_types",
            "max_window_layers", "quantization",
        }
        extra = {k: v for k, v in d.items() if k not in known}
        dc_rest = {k: v for k, v in dc.items() if k not in ("mask_token_id", "target_layer_ids")}
        if dc_rest:  # other dflash_config keys (e.g. a variant's own), kept as they were
            extra["dflash_config"] = dc_rest
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=n_layers,
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            target_layer_ids=list(dc["target_layer_ids"]),
            mask_token_id=int(dc["mask_token_id"]),
            block_size=int(d.get("block_size", dc.get("block_size", 16))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope),
            num_target_layers=d.get("num_target_layers") or dc.get("num_target_layers") or 0,
            model_type=d.get("model_type", "qwen3"),
            max_position_embeddings=int(d.get("max_position_embeddings") or 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """The published config.json shape: every key a z-lab draft and dflash-mlx's loader read."""
        d = asdict(self)
        extra = d.pop("extra")
        d["dflash_config"] = {
            **(extra.pop("dflash_config", None) or {}),
            "mask_token_id": d.pop("mask_token_id"),
            "target_layer_ids": d.pop("target_layer_ids"),
        }
        if not self.num_target_layers:  # old configs: at least the highest captured layer + 1
            d["num_target_layers"] = max(self.target_layer_ids) + 1
        d["architectures"] = ["DFlashDraftModel"]
        d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        d["max_window_layers"] = self.num_hidden_layers
        out = {**PUBLISHED_DEFAULTS, **extra, **d}
        return dict(sorted(out.items()))


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(hd, cfg.rope_theta, False, cfg.rope_scaling,
                                    cfg.max_position_embeddings)

    def _kv(self, x: mx.array, offset: int,
            kv: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array]:
        """Keys (normed, rotated) and values of rows x; `kv`: their k_proj / v_proj products
        computed already (the drafter's one product for every layer's context rows)."""
        B, L, _ = x.shape
        k, v = kv or (self.k_proj(x), self.v_proj(x))
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def add_context(self, context: mx.array, cache: KVCache,
                    kv: tuple[mx.array, mx.array] | None = None) -> None:
        """Append projected context rows (at the next positions) to this layer's cache."""
        k, v = self._kv(context, cache.offset, kv)
        cache.update_and_fetch(k, v)

    def __call__(
        self,
        x: mx.array,
        block_offset: int | mx.array,
        cache: KVCache | None = None,
        context: mx.array | None = None,
        mask: mx.array | None = None,
    ) -> mx.array:
        """Block queries over [cached context ; explicit context ; block] keys, non-causal."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=block_offset)
        kb, vb = self._kv(x, block_offset)
        ks, vs = [], []
        if cache is not None and cache.keys is not None:
            kc, vc = cache.keys_and_values()
            ks.append(kc)
            vs.append(vc)
        if context is not None:
            kc, vc = self._kv(context, 0)
            ks.append(mx.broadcast_to(kc, (B, *kc.shape[1:])))
            vs.append(mx.broadcast_to(vc, (B, *vc.shape[1:])))
        if ks:
            kb = mx.concatenate([*ks, kb], axis=2)
            vb = mx.concatenate([*vs, vb], axis=2)
        out = verifyattn.attention(q, kb, vb, self.scale, mask)  # MLX's, or fewq's kernel when inferring
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(verifyattn.swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, h, block_offset, cache=None, context=None, mask=None):
        h = h + self.self_attn(self.input_layernorm(h), block_offset, cache, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft network. Call with block embeddings and new context features."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def project(self, features: mx.array) -> mx.array:
        """Target features [B, C, K*D] -> context rows [B, C, D], shared by all layers."""
        return self.hidden_norm(self.fc(features))

    def add_context(self, features: mx.array, cache: list[KVCache],
                    kv_stack: Shared | None = None) -> None:
        """Project new target feature rows and append their K/V to every layer's cache;
        `kv_stack` (fuse.context_stack): every layer's K/V products as one."""
        ctx = self.project(features)
        kv = kv_stack.all(ctx) if kv_stack is not None else None
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            layer.self_attn.add_context(ctx, c, None if kv is None else (kv[2 * i], kv[2 * i + 1]))

    def __call__(
        self,
        block_embeds: mx.array,
        block_offset: int | mx.array,
        cache: list[KVCache] | None = None,
        context: mx.array | None = None,
        mask: mx.array | None = None,
    ) -> mx.array:
        """Block hidden states after the final norm, [B, L, D]; feed them to the target's LM head.

        `context` (already projected, positions 0..C-1) is the training path; inference uses
        the cache filled by add_context().
        """
        h = block_embeds
        caches = cache if cache is not None else [None] * len(self.layers)
        for layer, c in zip(self.layers, caches):
            h = layer(h, block_offset, c, context, mask)
        return self.norm(h)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_ROWS = re.compile(r"(.*)\.__rows(\d+)of(\d+)")  # a tensor split by rows into checkpoint parts


def join_rows(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Undo a checkpoint's row split (`NAME.__rows{i}of{n}` -> NAME; training/checkpoint.py
    splits tensors larger than a part)."""
    out, split = {}, {}
    for k, v in weights.items():
        m = _ROWS.fullmatch(k)
        if m:
            split.setdefault(m.group(1), {})[int(m.group(2))] = (int(m.group(3)), v)
        else:
            out[k] = v
    for name, pieces in split.items():
        n = next(iter(pieces.values()))[0]
        if sorted(pieces) != list(range(n)):
            raise ValueError(f"checkpoint tensor {name}: parts {sorted(pieces)} of {n}")
        out[name] = mx.concatenate([pieces[i][1] for i in range(n)], axis=0)
    return out


def read_config(path: str | Path) -> DraftConfig:
    """A draft directory's config.json, read and checked: all that `dflash draft-vocab` needs to
    tell a draft from a target's folder. FileNotFoundError without one; ValueError naming what
    is wrong."""
    return _read_config(Path(path))[0]


def _read_config(path: Path) -> tuple[DraftConfig, dict[str, Any]]:
    """read_config's answer and the raw JSON it came from (load_draft also reads quantization)."""
    cfg_file = path / "config.json"
    if not path.exists():  # a mistyped --draft: say so, not "no config.json in" a folder that is not there
        raise FileNotFoundError(f"draft directory not found: {path}")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is a file, not a draft directory")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in draft directory {path}")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{cfg_file} is not readable JSON ({e})") from None
    try:
        return DraftConfig.from_dict(raw), raw
    except KeyError as e:
        raise ValueError(f"{path}: draft config.json lacks {e}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def load_draft(path: str | Path, dtype: mx.Dtype | None = None) -> DFlashDraft:
    """Load a draft directory in the published DFlash format, or a training checkpoint (its
    parts, tensors split by rows included)."""
    path = Path(path)
    cfg, raw = _read_config(path)
    model = DFlashDraft(cfg)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in draft directory {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except RuntimeError as e:  # cut short, or a link to a removed file: MLX's bare RuntimeError
            raise ValueError(f"{path}: damaged draft files ({str(e).splitlines()[0]})") from None
    weights = {k.removeprefix("model."): v for k, v in join_rows(weights).items()}
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens", "lm_head"))}
    quant = raw.get("quantization")
    if quant:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        from ..daemon.protocol import reason_line

        raise ValueError(f"{path}: the draft's weights do not match its config.json ({reason_line(e)})") from None
    if dtype is not None and not quant:
        model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def save_draft(model: DFlashDraft, path: str | Path, extra_config: dict | None = None) -> None:
    """Write the draft in the published format (config.json + model.safetensors).

    The config carries every key of a published DFlash config (DraftConfig.to_dict) plus the
    weights' dtype; `extra_config` adds or overrides keys (e.g. the target's bos/eos ids).
    Only the draft's own weights are written: never an embedding or an lm_head.
    """
    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    weights = dict(tree_flatten(model.parameters()))
    borrowed = [k for k in weights if k.startswith(("embed_tokens", "lm_head"))]
    if borrowed:
        raise ValueError(f"a DFlash draft uses the target's embedding and LM head; got {borrowed}")
    cfg["dtype"] = str(model.fc.weight.dtype).replace("mlx.core.", "")
    if extra_config:
        cfg.update(extra_config)
    qlayers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    if qlayers:
        cfg["quantization"] = {"group_size": qlayers[0].group_size, "bits": qlayers[0].bits}
    else:
        cfg.pop("quantization", None)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def quantize_draft(model: DFlashDraft, bits: int = 4, group_size: int = 64) -> None:
    """Quantize the draft's linear layers in place (the context projection stays full precision)."""
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda p, m: isinstance(m, nn.Linear)
        and p != "fc"
        and m.weight.shape[-1] % group_size == 0,
    )
