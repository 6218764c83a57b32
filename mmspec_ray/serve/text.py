"""Committed token ids -> streamed text deltas whose concatenation is exactly the final answer's text.

A delta never ends inside a possible stop string (held back until it is ruled out) nor in the middle of a
multi-byte character (the tokenizer's U+FFFD), so nothing sent ever has to be taken back.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class TextStream:
    """Turns each step's committed ids into the next piece of text to send."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: list[int]) -> str:
        """Add ids; return the new text that is safe to send now (maybe "")."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = [text.find(s) for s in self.stop if s in text]
        if cut:
            text = text[: min(cut)]
        else:
            text = text[: len(text) - self._hold(text)]
        return self._advance(text)

    def finish(self, final_text: str) -> str:
        """The rest of the final text (what the non-streamed answer holds)."""
        return self._advance(final_text)

    def _hold(self, text: str) -> int:
        """Characters at the end of `text` that may still change: a stop string's prefix, a partial character."""
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            log.warning("tokenizer revised already-streamed text; sending only what extends it")
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta
