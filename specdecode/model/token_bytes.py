"""The bytes each token id stands for, so that texts can move between two tokenizers without loss.

A Hugging Face tokenizer keeps its vocabulary as strings in its own spelling: byte-level BPE (GPT-2, Qwen,
SmolLM2, Llama 3) writes each byte as one printable character; SentencePiece-style vocabularies write a space as
"▁" and an unknown byte as "<0xNN>" (byte fallback). `token_bytes` undoes the spelling, id by id; added and
special tokens stand for their own text. Concatenating a text's tokens' bytes gives the text back, except that a
SentencePiece tokenizer may prepend one space to a whole text (`encode_with_ends` takes it off).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _types(node: Any) -> set[str]:
    """Every component type named in a tokenizer.json section (a Sequence's parts included)."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        for value in node.values():
            found |= _types(value)
        return found
    if isinstance(node, list):
        return set().union(*(_types(v) for v in node)) if node else set()
    return set()


def token_bytes(hf: Any) -> list[bytes]:
    """[len(hf)] the bytes of every id of a Hugging Face fast tokenizer (ids it lacks: b"")."""
    spec = json.loads(hf.backend_tokenizer.to_str())
    decoder = _types(spec.get("decoder"))
    byte_level = "ByteLevel" in decoder
    fallback = "ByteFallback" in decoder or bool((spec.get("model") or {}).get("byte_fallback"))
    alphabet = byte_level_alphabet()
    added = {t["id"] for t in spec.get("added_tokens", [])}
    out = [b""] * len(hf)
    for piece, i in hf.get_vocab().items():
        if i >= len(out):
            continue
        if i in added:
            out[i] = piece.encode()
        elif byte_level and all(c in alphabet for c in piece):
            out[i] = bytes(alphabet[c] for c in piece)
        elif fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            out[i] = bytes([int(m.group(1), 16)])
        else:
            out[i] = piece.replace("▁", " ").encode()
    return out


def complete_utf8(data: bytes | bytearray) -> int:
    """Length of the longest prefix of `data` that ends on a whole UTF-8 character (a token may end inside one)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:  # ASCII: complete
            return n if back == 1 else n - back + 1
        if b >= 0xC0:  # a lead byte: complete if its sequence fits
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n  # no lead byte in reach: invalid bytes, kept as they are


def encode_with_ends(hf: Any, table: list[bytes], text: str) -> tuple[list[int], list[int]]:
    """`text` in `hf`'s ids (special tokens written in it parsed, none added) and each id's end as a byte offset
    into text.encode(). The ends come from the ids' bytes; a space the tokenizer prepends to the whole text is
    taken off the first id."""
    ids = hf.backend_tokenizer.encode(text, add_special_tokens=False).ids
    ends, at = [], 0
    for i in ids:
        at += len(table[i])
        ends.append(at)
    extra = at - len(text.encode())
    if extra > 0:
        ends = [max(0, e - extra) for e in ends]
    return ids, ends
