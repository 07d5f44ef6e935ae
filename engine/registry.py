"""Known target -> draft pairs, resolved offline from local paths and the local HF cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Target name (as people type it) -> draft repository name. Matching is by the target's last
# path component, case-insensitive, so a local directory named like the repo also resolves.
KNOWN_PAIRS: dict[str, str] = {
    "Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "Qwen3.6-27B": "z-lab/Qwen3.6-27B-DFlash",
    "Qwen3.6-35B-A3B": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "gemma-4-E4B-it": "z-lab/gemma-4-E4B-it-DFlash",
    "gemma-4-31B-it": "z-lab/gemma-4-31B-it-DFlash",
    "Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    # Ours, bundled in engine/drafts/ (trained with `dflash train-draft`).
    "SmolLM2-135M-Instruct": "dflash/SmolLM2-135M-Instruct-DFlash",
}

_SUFFIXES = ("-4bit", "-8bit", "-bf16", "-fp16", "-mlx", "-MLX")


class DraftNotFoundError(FileNotFoundError):
    """No draft is known or present locally for a target."""


def _base_name(target: str) -> str:
    name = Path(target.rstrip("/")).name
    changed = True
    while changed:
        changed = False
        for s in _SUFFIXES:
            if name.endswith(s):
                name, changed = name[: -len(s)], True
    return name


def hf_cache_dir(repo: str) -> Path | None:
    """The newest snapshot of `repo` in the local Hugging Face cache, if any."""
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    snaps = Path(home) / f"models--{repo.replace('/', '--')}" / "snapshots"
    if snaps.is_dir():
        for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            if (snap / "config.json").is_file():
                return snap
    return None


def resolve_draft(target: str, search_dirs: list[Path] | None = None, model_dir: str | Path | None = None) -> Path:
    """Find the draft for `target` (its name as typed: a path or a repo id) without the network,
    or explain how to get one; `model_dir`: where the model is (default `target`). Looked for in
    turn: the model folder's own draft/, drafts named after the model (search_dirs, DFLASH_DRAFTS,
    the bundled ones), a bundled draft of the model's shape, the HF cache."""
    inner = Path(model_dir or target) / "draft"  # beside the model, as `dflash make-tiny` writes it
    if (inner / "config.json").is_file():
        return inner
    base = _base_name(target).lower()
    repo = next((r for t, r in KNOWN_PAIRS.items() if t.lower() == base), None)
    dirs = list(search_dirs or [])
    env = os.environ.get("DFLASH_DRAFTS")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(Path(__file__).parent / "drafts")
    names = [f"{_base_name(target)}-DFlash"] + ([repo.split("/")[1]] if repo else [])
    for d in dirs:
        for n in names:
            cand = d / n
            if (cand / "config.json").is_file():
                return cand
    if not repo:
        bundled = _bundled_for_shape(Path(model_dir or target))
        if bundled is not None:
            return bundled
    if repo:
        snap = hf_cache_dir(repo)
        if snap is not None:
            return snap
        raise DraftNotFoundError(
            f"the draft for {target} is {repo}, but it is not in the local Hugging Face cache; "
            f"download it on a connected machine (huggingface-cli download {repo}) or pass --draft"
        )
    raise DraftNotFoundError(
        f"no DFlash draft is known for {target} (drafts are found by the model folder's name, "
        f"e.g. SmolLM2-135M-Instruct, or for a bundled draft by the model's shape); pass --draft "
        f"PATH, or train one with `dflash train-draft --target {target} --out DIR`"
    )


def _shape(config: dict) -> tuple | None:
    """What a draft must share with its target: hidden size, vocabulary, layer count."""
    c = config.get("text_config", config)
    try:
        return int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None


def _bundled_for_shape(target: Path) -> Path | None:
    """A bundled draft whose target has this local model's shape: `dflash import` can write the
    default target into a folder of any name. A draft of another model of the same shape would
    still be lossless (the target decides every token); it would only be slower."""
    try:
        want = _shape(json.loads((target / "config.json").read_text()))
    except (OSError, ValueError):
        return None
    if want is None:
        return None
    for d in sorted((Path(__file__).parent / "drafts").iterdir()):
        try:
            cfg = json.loads((d / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if (cfg.get("hidden_size"), cfg.get("vocab_size"), cfg.get("num_target_layers")) == want:
            return d
    return None
