"""Turning user text or chat messages into prompt token ids with the tokenizer's template."""

from __future__ import annotations

import json
from typing import Any, Sequence


def prompt_lines(text: str) -> list[tuple[str, str]]:
    """(kind, prompt) per non-blank line of a prompt file: JSONL ({"prompt": ..., "kind": ...},
    the held-out sets' format) or one plain prompt per line (kind "file")."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                d = json.loads(line)
                out.append((str(d.get("kind", "file")), str(d["prompt"])))
            except (ValueError, KeyError, AttributeError) as e:
                raise ValueError(f"prompt file line {n}: a JSON line needs a \"prompt\" ({e})") from e
        else:
            out.append(("file", line))
    return out


def build_prompt(
    tokenizer: Any,
    prompt: str | Sequence[dict] | None = None,
    *,
    system: str | None = None,
    raw: bool = False,
    template_args: dict | None = None,
) -> list[int]:
    """Token ids for a text prompt or a list of chat messages.

    Text is wrapped as one user message (after an optional system message) when the tokenizer
    has a chat template and `raw` is false; otherwise it is encoded as is (and a system message
    is refused: there is nowhere to put it).
    """
    if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
        raise ValueError("empty prompt")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if system and (raw or not has_template):  # it would vanish without a word
        raise ValueError("a system message goes into the chat template, which "
                         + ("raw text leaves out" if raw else "this model's tokenizer does not have"))
    if isinstance(prompt, str):
        if raw or not has_template:
            return list(tokenizer.encode(prompt))
        messages: list[dict] = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
        if not messages:
            raise ValueError("empty message list")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs string 'role' and 'content'")
        if not has_template:
            text = "\n".join(m["content"] for m in messages)
            return list(tokenizer.encode(text))
    if system:
        messages = [{"role": "system", "content": system}] + messages
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **(template_args or {})
    )
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
