"""Media placeholder tokens typed into a request's text. The chat template places one placeholder per media part and
the processor expands it; a placeholder the user typed as text breaks the count (the processor's raw ValueError on
LLaVA, LLaVA-NeXT, Qwen2.5-VL) or silently shifts media. Found here so the target can name the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def placeholder_tokens(processor: Any) -> dict[str, str]:
    """{placeholder string: "image" | "video"} from the processor's (or its tokenizer's) image/video tokens."""
    found: dict[str, str] = {}
    tokenizer = getattr(processor, "tokenizer", None)
    for kind in ("image", "video"):
        for owner in (processor, tokenizer):
            token = getattr(owner, f"{kind}_token", None) if owner is not None else None
            if isinstance(token, str) and token.strip():
                found.setdefault(token, kind)
    return found


def request_texts(prompt: str | None, messages: list[dict] | None) -> Iterator[tuple[str, str]]:
    """(field name, text) for every piece of user-written text: the prompt, or each message's text content."""
    if messages is None:
        if prompt is not None:
            yield "prompt", prompt
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield f"messages[{i}].content", content
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield f"messages[{i}].content[{j}].text", part["text"]


def typed_placeholder(prompt: str | None, messages: list[dict] | None,
                      tokens: dict[str, str]) -> tuple[str, str, str] | None:
    """The first (field, kind, token) where user text contains a media placeholder token; None when clean."""
    for field, text in request_texts(prompt, messages):
        for token, kind in tokens.items():
            if token in text:
                return field, kind, token
    return None
