"""Incremental detokenization and stop-string handling for one sequence.

Decoding token by token breaks multi-byte characters and merged pieces, so we decode a
short window and release text only once it no longer ends in a replacement character
(the approach of HF's TextStreamer and vLLM).
"""

from __future__ import annotations

from specdecode.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (may be empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""


class StopStringMatcher:
    """Finds stop strings in growing text and says how much text is safe to stream."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, new_len: int) -> int:
        """Index where the first stop string starts, looking only where new text can complete one; -1 if none."""
        if not self.stops:
            return -1
        start = max(0, len(text) - new_len - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def safe_len(self, text: str) -> int:
        """Length of the prefix of text that can never become part of a stop string."""
        if not self.stops:
            return len(text)
        for cut in range(max(0, len(text) - self.hold), len(text)):
            tail = text[cut:]
            if any(s.startswith(tail) for s in self.stops):
                return cut
        return len(text)
