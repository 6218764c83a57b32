"""What a target is asked (`Request`: a prompt or messages plus media) and the errors a request can meet, below every
module that reads them (the target base class, the chat-message helpers, the batch rows)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


class TargetError(ValueError):
    """A request this target cannot serve (wrong media kind, too long, missing processor ...). Says what to do."""


class InvalidRequest(TargetError):
    """The request's own shape is wrong (a field's content, not a target limit); the message starts with the field."""


class PromptTooLong(TargetError):
    """Prompt + max_new_tokens exceed the target's context (callers report it as its own error kind)."""


@dataclass(frozen=True)
class Request:
    """One user turn: a text prompt (or OpenAI-style messages) plus its media."""

    prompt: str | None = None
    messages: list[dict] | None = None  # OpenAI-style; overrides `prompt` when given
    images: tuple[Image.Image, ...] = ()
    videos: tuple[tuple[Image.Image, ...], ...] = ()  # each video as its sampled RGB frames

    def __post_init__(self) -> None:
        if self.prompt is None and self.messages is None:
            raise TargetError("a request needs a prompt or messages")
