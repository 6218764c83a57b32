"""The single error type raised for any unusable media input."""

from __future__ import annotations

from typing import Literal

MediaErrorKind = Literal["corrupt", "truncated", "empty", "too_large", "unsupported", "not_found", "io",
                         "unavailable", "aspect_ratio"]
# Kinds that say nothing about the media itself (the store was unreachable): worth trying again later.
TRANSIENT_KINDS = ("unavailable",)


class MediaError(ValueError):
    """A media input could not be used. `kind` is machine-readable; the message says what to do."""

    def __init__(self, kind: MediaErrorKind, message: str, source: str | None = None) -> None:
        self.kind: MediaErrorKind = kind
        self.source = source
        where = f" ({source})" if source else ""
        super().__init__(f"{kind}: {message}{where}")
