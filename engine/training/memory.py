"""One training step's memory, estimated from its shapes before any data or compile work, and
refused when it cannot fit: `--seqs-per-batch 100000` or `--block-size 100000 --max-len 200000`
ran MLX out of memory (a killed process, or a machine swapping for minutes) instead of a line.

The estimate is a FLOOR: only tensors the step must hold at the same time are counted, each once
(one layer's transients, not a graph's worth), so a configuration refused here could not have
run (on the CPU real steps peaked at 1.8x to 2.5x it), and every configuration that runs today
passes with room to spare (the campaigns: 32 sequences x 64 blocks of 16 at 640 tokens, SmolLM2
with a draft grown to 8 layers of MLP 2304, on an 80 GB H100: a floor of about 24 GiB, 29 GiB
with --kl-weight, most of it the logits).

    weights     the target's weights (as loaded) + the draft's fp32 masters, their gradients,
                AdamW's two moments and the --compute-dtype copy the loss runs on
    target      the frozen target over [S, L]: the captured features [S, L, K*D], its last hidden
                states [S, L, D] and one layer's MLP (gate and up, [S, L, I] each)
    attention   the draft over S x A blocks of B rows: the boolean mask [S, A*B, L + A*B], each
                layer's softmax [S, H, A*B, L + A*B] (MLX differentiates attention through its
                unfused fallback, which keeps them for the backward pass) and one more, each
                layer's keys and values over [L + A*B] rows and its inputs and MLP rows, the
                projected context [S, L, D]
    logits      the draft's logits over the LM head's rows [S, A, B-1, V] in fp32 and their
                gradient; with --kl-weight the target's log-probabilities too (--argmax-labels
                alone needs only their argmax: the target's logits may be gone before the draft's)

DFLASH_TRAIN_MEMORY_GIB: a number of GiB replaces the measured memory (a machine the probe reads
wrong); `off` skips the check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
ENV = "DFLASH_TRAIN_MEMORY_GIB"

# the flags that shrink each part, the first the one to try first
_LEVERS = {
    "logits": ("--seqs-per-batch", "--anchors-per-seq", "--block-size"),
    "attention": ("--block-size", "--anchors-per-seq", "--seqs-per-batch"),
    "target": ("--max-len", "--seqs-per-batch"),
    "weights": ("--layers",),
}
_NAMES = {"logits": "the draft's logits", "attention": "the draft's attention",
          "target": "the target pass", "weights": "weights + optimiser"}
# train-draft's defaults: a flag far above its own is named first
_DEFAULTS = {"--seqs-per-batch": 16, "--anchors-per-seq": 64, "--block-size": 16}


@dataclass(frozen=True)
class StepShape:
    """What one training step's memory depends on (per rank). Byte sizes: 4 fp32, 2 bf16."""

    seqs: int  # S, --seqs-per-batch
    seq_len: int  # L, the padded sequence length (<= --max-len)
    anchors: int  # A, --anchors-per-seq
    block_size: int  # B
    hidden: int  # D, the target's and the draft's
    vocab: int  # V, the LM head's rows
    num_capture: int  # K, target layers captured
    target_intermediate: int  # the target's MLP width
    draft_layers: int
    draft_intermediate: int
    heads: int  # the draft's attention heads
    kv_heads: int
    head_dim: int
    target_weight_bytes: int  # the loaded target, as it sits in memory
    draft_params: int  # trainable parameters (fp32 masters)
    target_bytes: int = 2  # --dtype
    compute_bytes: int = 2  # --compute-dtype
    target_logits: bool = False  # --kl-weight > 0: the target's log-probabilities beside the draft's


def step_memory(s: StepShape) -> dict[str, int]:
    """The floor of one step's memory in bytes, by part (module docstring); pure arithmetic."""
    S, L, A, B, D = s.seqs, s.seq_len, s.anchors, s.block_size, s.hidden
    rows = A * B  # the draft's rows per sequence
    keys = L + rows  # the keys each of them is masked against
    copy = 0 if s.compute_bytes == 4 else s.compute_bytes  # cast_tree keeps fp32 as it is
    weights = s.target_weight_bytes + s.draft_params * (4 + 4 + 8 + copy)
    target = S * L * (s.num_capture * D + D + 2 * s.target_intermediate) * s.target_bytes
    per_layer = (2 * s.kv_heads * keys * s.head_dim + rows * (D + 2 * s.draft_intermediate)) * s.compute_bytes
    # MLX attends through its unfused fallback while differentiating (fast SDPA's use_fallback
    # under grad tracing): each layer's softmax [S, H, A*B, L + A*B] is kept for the backward
    # pass, and the last one is computed from its scores, so layers + 1 of them at once
    scores = S * s.heads * rows * keys * s.compute_bytes * (s.draft_layers + 1)
    attention = S * rows * keys + S * L * D * s.compute_bytes + S * s.draft_layers * per_layer + scores
    label_rows = S * A * (B - 1)
    logits = label_rows * s.vocab * 4 * (3 if s.target_logits else 2)
    return {"weights": weights, "target": target, "attention": attention, "logits": logits}


def seqs_that_fit(s: StepShape, available: int) -> int:
    """The most sequences per batch whose floor fits in `available` bytes (0: not even one);
    every part but the weights grows linearly with S."""
    one = step_memory(StepShape(**{**s.__dict__, "seqs": 1}))
    per_seq = sum(v for k, v in one.items() if k != "weights")
    return max(0, (available - one["weights"]) // max(per_seq, 1))


def _size(b: int) -> str:
    return f"{b / GIB:,.1f} GiB" if b >= GIB else f"{b / (1 << 20):,.1f} MiB"


def refusal(s: StepShape, available: int, where: str, length_known: bool = True) -> str | None:
    """The error line when one step's floor is over `available` bytes (`where`: what they
    are), naming the parts and the flags to lower; None when it fits. `length_known` False: the
    data's sequence length is not known yet, s.seq_len is the shortest it can be."""
    parts = step_memory(s)
    need = sum(parts.values())
    if need <= available:
        return None
    given = {"--seqs-per-batch": s.seqs, "--anchors-per-seq": s.anchors, "--block-size": s.block_size}
    above = sorted((f for f in _DEFAULTS if given[f] > _DEFAULTS[f]), key=lambda f: -given[f] / _DEFAULTS[f])
    flags = above + [f for f in _LEVERS[max(parts, key=parts.get)] if f not in above]
    fit = seqs_that_fit(s, available)
    named = [f"{f} (at most {fit} fit with the rest as they are)" if f == "--seqs-per-batch" and 0 < fit < s.seqs
             else f for f in flags]
    detail = ", ".join(f"{_NAMES[k]} {_size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    tokens = f"{s.seq_len} tokens each" + ("" if length_known else " at the least")
    return (f"one training step needs at least {_size(need)} ({detail}; {s.seqs} sequences x {s.anchors} "
            f"blocks of {s.block_size} rows, {tokens}) but {where} is {_size(available)}: "
            f"lower {', '.join(named[:-1]) + ' or ' if len(named) > 1 else ''}{named[-1]}; "
            f"{ENV}=off skips this check")


# --- what the machine can give -----------------------------------------------------------------
def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf(name: str) -> int | None:
    try:
        pages, size = os.sysconf(name), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def device_memory(mx: Any) -> tuple[int, str] | None:
    """The device's total memory in bytes as MLX reports it, with the key it comes under (CUDA's
    total_memory, Metal's memory_size); None where none is reported."""
    try:
        info = mx.device_info()
    except Exception:  # an MLX without it
        return None
    for key in ("total_memory", "memory_size"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return int(info[key]), key
    return None


def available_memory(mx: Any) -> tuple[int | None, str]:
    """(bytes the step may use, what they are), or (None, why not known): on a GPU the device's
    total memory (mx.device_info: Metal's memory_size, CUDA's total_memory); on the CPU the
    system's available RAM (/proc/meminfo MemAvailable, else sysconf) plus what MLX already
    holds (the target's weights, counted in the estimate)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            gib = float(env)
        except ValueError:
            gib = float("nan")
        if not gib > 0 or gib == float("inf"):
            raise ValueError(f"{ENV}={env!r}: expected a number of GiB above 0, or off")
        return int(gib * GIB), ENV
    if mx.default_device() == mx.gpu:
        found = device_memory(mx)
        if found is not None:
            return found[0], f"the GPU's memory ({found[1]})"
        return None, "the GPU's memory is not reported"
    held = 0
    try:
        held = int(mx.get_active_memory())
    except Exception:
        pass
    free = _meminfo_available()
    if free is not None:
        return free + held, "this machine's available RAM"
    free = _sysconf("SC_AVPHYS_PAGES") or _sysconf("SC_PHYS_PAGES")
    if free is not None:
        return free + held, "this machine's RAM"
    return None, "this machine's memory is not reported"


def check_step_memory(shape: StepShape, mx: Any, length_known: bool = True) -> None:
    """Raise ValueError when one step cannot fit (skipped with DFLASH_TRAIN_MEMORY_GIB=off, or
    when the memory is not known); `length_known`: see refusal."""
    if os.environ.get(ENV, "").strip().lower() == "off":
        return
    available, where = available_memory(mx)
    if available is None:
        return
    line = refusal(shape, available, where, length_known)
    if line:
        raise ValueError(line)
