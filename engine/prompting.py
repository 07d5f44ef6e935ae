"""Turning user text or chat messages into prompt token ids with the tokenizer's template."""

from __future__ import annotations

import json
from typing import Any, Sequence


_NOT_JSON = object()


def _json_value(line: str) -> Any:
    """The JSON value a whole line is; _NOT_JSON when it is text."""
    try:
        return json.loads(line)
    except ValueError:
        return _NOT_JSON


def _json_kind(value: Any) -> str:
    """A JSON value's kind in words, as a refusal names it."""
    if isinstance(value, bool) or value is None:
        return f"JSON {json.dumps(value)}"
    return {list: "a JSON array", str: "a JSON string"}.get(type(value), "a JSON number")


def prompt_lines(text: str) -> list[tuple[str, str]]:
    """(kind, prompt) per non-blank line of a prompt file: JSONL ({"prompt": ..., "kind": ...},
    the held-out sets' format) or one plain prompt per line (kind "file"), the two mixed.

    A line that is JSON but no prompt object is refused with its number rather than asked as
    text: a JSON array anywhere (e.g. a list of chat messages), and in a file with JSON object
    lines any other JSON value (a number, a string, true/false/null). A file without an object
    line is plain text, every line a prompt as written. A "kind", where given, is a non-empty
    string like the prompt."""
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    jsonl = any(line.startswith("{") for _, line in lines)
    out = []
    for n, line in lines:
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError as e:  # the parser's words say where the line breaks
                raise ValueError(f"prompt file line {n}: a JSON line needs a \"prompt\" ({e})") from e
            if not isinstance(d, dict) or "prompt" not in d:  # said plainly, not as a KeyError's repr
                raise ValueError(f"prompt file line {n}: a JSON line needs a \"prompt\" (its keys: "
                                 f"{', '.join(map(json.dumps, d)) or 'none'})")
            prompt = d["prompt"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"prompt file line {n}: \"prompt\" must be a non-empty string, "
                                 f"got {json.dumps(prompt)[:40]}")
            kind = d.get("kind", "file")
            if not isinstance(kind, str) or not kind.strip():  # it names the report's groups
                raise ValueError(f"prompt file line {n}: \"kind\" must be a non-empty string, "
                                 f"got {json.dumps(kind)[:40]}")
            out.append((kind, prompt))
            continue
        value = _json_value(line)
        if isinstance(value, list) or (jsonl and value is not _NOT_JSON):
            raise ValueError(f"prompt file line {n}: {_json_kind(value)}, not a prompt "
                             "(a JSON line is an object with a \"prompt\")")
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
