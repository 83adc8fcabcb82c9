"""OpenAI's two logprobs shapes from the engine's `TokenLogprob`s.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A token's string is its own decoding (special tokens included); its bytes are the token's real bytes where the
tokenizer is byte-level (a token holding part of a UTF-8 character decodes to U+FFFD, its bytes do not).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from specdecode.engine.logprobs import TokenLogprob
from specdecode.model.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """Strings and bytes of token ids, cached (a server formats the same tokens over and over)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text:  # part of a character: the byte-level piece holds the real bytes
                piece = self.tokenizer.id_to_token(token_id) or ""
                table = _byte_decoder()
                if piece and all(c in table for c in piece):
                    raw = bytes(table[c] for c in piece)
            hit = self._cache[token_id] = (text, list(raw))
            if len(self._cache) > 200_000:  # bounded: a vocabulary fits; anything beyond is a bug
                self._cache.clear()
        return hit


def chat_logprobs(entries: list[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """The chat choice's ``logprobs`` object for these tokens."""
    content = []
    for e in entries:
        token, raw = text(e.token_id)
        top = [{"token": text(t)[0], "logprob": lp, "bytes": text(t)[1]} for t, lp in e.top]
        content.append({"token": token, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries: list[TokenLogprob], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The completion choice's ``logprobs`` object; `offset`: characters of the text before these tokens.
    Each top_logprobs dict holds the alternatives and the chosen token (as vLLM)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        token = text(e.token_id)[0]
        tokens.append(token)
        token_logprobs.append(e.logprob)
        top: dict[str, float] = {}
        for t, lp in e.top:  # tokens with the same string (parts of characters): the likeliest stays
            top.setdefault(text(t)[0], lp)
        top.setdefault(token, e.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
