"""Text between two tokenizers: the target's tokens as the draft model's context, the draft's tokens as the
target's draft.

A draft model with another vocabulary reads the target's text, not its ids. Each row keeps the draft ids its
cache holds (`DraftText`): the tokenization of the target's text so far, then the tokens the draft fed while
drafting. When the target's text grows, `TextBridge.sync` re-tokenizes only its tail, from a few tokens before
the first byte where the cached ids and the new text disagree (tokenization is not prefix-stable: "hel" may be
one token until "lo" follows); the ids before that point stay in the draft's cache, the rest are fed again. That
is the rollback to the last agreed text boundary: a partly accepted draft, or a draft token whose bytes the
target spelled differently, costs only the re-feed of the tokens after it.

The draft's continuation goes back as text too (`TextBridge.to_target`): its bytes, re-tokenized by the
target's tokenizer. Such a draft is a point mass in the target's ids, verified as any deterministic draft is:
greedy output is the target's own, and sampling keeps the target's distribution exactly (a deterministic
proposal x is accepted with probability p(x), else a token is drawn from p with x removed).

A target token may end inside a UTF-8 character; the draft reads the text up to the last whole character and
the bytes after it are pending: a continuation counts only if it spells them first, and the bytes that complete
the character go back as the target's one-byte tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from specdecode.model.token_bytes import complete_utf8, encode_with_ends, token_bytes

LOOKBEHIND = 4
"""Cached ids re-tokenized before the first disagreeing byte: a merge reaches back at most a few tokens."""
WORD_SEARCH = 16
"""Ids further back searched for one that starts a word (a space or a line before it): the pre-tokenizers of
byte-level BPE and SentencePiece split there, so the tail tokenizes there as it does in the whole text."""

SAMPLE_TEXT = (
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number, and explain it.<|im_end|>\n"
    "<|im_start|>assistant\nHere is an iterative version:\n\n```python\ndef fib(n: int) -> int:\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n\nIt keeps the last two numbers, so it runs "
    "in linear time and constant memory. For example, fib(10) returns 55.<|im_end|>\n"
)
"""Code and prose in a chat turn: the draft ids per target id on it price a cross-vocabulary draft."""


@dataclass
class DraftText:
    """One row's text as the draft model reads it."""

    raw: bytearray = field(default_factory=bytearray)
    """The target's text: the bytes of its first `synced` ids."""
    synced: int = 0
    ids: list[int] = field(default_factory=list)
    """Draft ids of the text (the draft's cache holds a prefix of them), then the ids it fed while drafting."""
    ends: list[int] = field(default_factory=list)
    """Byte end of each id in `spelled`."""
    spelled: bytearray = field(default_factory=bytearray)
    """The bytes `ids` spell."""
    pending: bytes = b""
    """The target text's bytes after its last whole character (the draft does not read them yet)."""

    def truncate(self, n: int) -> None:
        """Keep the first n ids."""
        del self.ids[n:], self.ends[n:]
        del self.spelled[self.ends[-1] if self.ends else 0 :]

    def append(self, token: int, spelled: bytes) -> None:
        self.ids.append(token)
        self.spelled += spelled
        self.ends.append(len(self.spelled))


def _word_start(row: DraftText, at: int) -> int:
    """The nearest id at or before `at` (within WORD_SEARCH) that starts a word; `at` if none does."""
    for i in range(at, max(0, at - WORD_SEARCH) - 1, -1):
        if i == 0:
            return 0
        begin = row.ends[i - 1]
        if row.spelled[begin : begin + 1] in (b" ", b"\n") or row.spelled[begin - 1 : begin] == b"\n":
            return i
    return at


def _common_prefix(a: bytes | bytearray, b: bytes | bytearray) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _leading_equal(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """How many (id, end) pairs two tokenizations share from their start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _valid_text(data: bytes) -> str:
    """The longest prefix of `data` that is valid UTF-8, decoded."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        return data[: e.start].decode()


class TextBridge:
    """The target's and the draft's tokenizers (Hugging Face fast tokenizers), with every id's bytes."""

    def __init__(self, target_hf: Any, draft_hf: Any) -> None:
        self.target_hf, self.draft_hf = target_hf, draft_hf
        self.target_bytes = token_bytes(target_hf)
        self.draft_bytes = token_bytes(draft_hf)
        self.target_byte_ids = {b[0]: i for i, b in enumerate(self.target_bytes) if len(b) == 1}
        """Byte value -> the target's id spelling just that byte (byte-level and byte-fallback vocabularies)."""
        self.draft_special = {i for i, t in draft_hf.added_tokens_decoder.items() if t.special}
        """Draft ids that end a text (EOS, turn markers): a continuation stops after one."""
        self.draft_per_target = (len(encode_with_ends(draft_hf, self.draft_bytes, SAMPLE_TEXT)[0])
                                 / max(1, len(self.target_encode(SAMPLE_TEXT))))

    def target_spelling(self, ids: list[int]) -> bytes:
        """The bytes of the target's ids (a padding id beyond the tokenizer, which a model may emit, spells
        nothing)."""
        table = self.target_bytes
        return b"".join(table[t] if t < len(table) else b"" for t in ids)

    def target_encode(self, text: str) -> list[int]:
        return self.target_hf.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def sync(self, row: DraftText, target_ids: list[int], cached: int) -> int:
        """Bring `row` to the target's text `target_ids`, of which the draft's cache holds row.ids[:cached].
        Returns how many cached ids stay valid; row.ids after them are what the draft must be fed."""
        row.raw += self.target_spelling(target_ids[row.synced :])
        row.synced = len(target_ids)
        whole = complete_utf8(row.raw)
        row.pending = bytes(row.raw[whole:])
        text = row.raw[:whole].decode(errors="replace")  # a byte no character takes reads as U+FFFD
        view = text.encode()
        cached = min(cached, len(row.ids))
        row.truncate(cached)
        agreed = _common_prefix(row.spelled, view)
        inside = bisect.bisect_right(row.ends, agreed)  # ids wholly inside the agreed bytes
        anchor = _word_start(row, max(0, inside - LOOKBEHIND))
        start = row.ends[anchor - 1] if anchor else 0
        ids, ends = self._encode_from(view, start, row.ids[anchor] if anchor < len(row.ids) and anchor else None)
        if ids is None:  # the tail does not tokenize as it does in context: re-tokenize the whole text
            anchor, start = 0, 0
            ids, ends = encode_with_ends(self.draft_hf, self.draft_bytes, text)
        ends = [start + e for e in ends]
        keep = anchor + _leading_equal(list(zip(row.ids[anchor:cached], row.ends[anchor:cached], strict=True)),
                                       list(zip(ids, ends, strict=True)))
        row.truncate(keep)
        row.ids += ids[keep - anchor :]
        row.ends += ends[keep - anchor :]
        row.spelled = bytearray(view)
        return keep

    def _encode_from(self, view: bytes, start: int, first: int | None) -> tuple[list[int] | None, list[int]]:
        """view[start:] tokenized on its own; None where that cannot stand for the text in context (it starts
        inside a character, or its first id is not the one the whole text had there)."""
        try:
            tail = view[start:].decode()
        except UnicodeDecodeError:
            return None, []
        ids, ends = encode_with_ends(self.draft_hf, self.draft_bytes, tail)
        if first is not None and (not ids or ids[0] != first):
            return None, []
        return ids, ends

    def draft_spelling(self, data: bytes) -> list[int]:
        """`data` (up to its last whole character) in the draft's ids, where they spell exactly it ([] where the
        tokenizer would change it, e.g. prepend a space)."""
        text = _valid_text(data[: complete_utf8(data)])
        if not text:
            return []
        ids, _ = encode_with_ends(self.draft_hf, self.draft_bytes, text)
        return ids if b"".join(self.draft_bytes[i] for i in ids) == text.encode() else []

    def continuation(self, draft_ids: list[int]) -> bytes:
        return b"".join(self.draft_bytes[i] for i in draft_ids)

    def to_target(self, pending: bytes, spelled: bytes) -> list[int]:
        """The target's ids for the draft's continuation `spelled` of a text whose pending bytes are `pending`
        ([] where the continuation does not spell them). Bytes after the last whole character are left out."""
        if not spelled.startswith(pending):
            return []
        rest = spelled[len(pending) :]
        lead: list[int] = []
        while rest and 0x80 <= rest[0] < 0xC0 and pending:  # completes the pending character
            tok = self.target_byte_ids.get(rest[0])
            if tok is None:
                return []
            lead.append(tok)
            rest = rest[1:]
        text = _valid_text(rest[: complete_utf8(rest)])
        return lead + (self.target_encode(text) if text else [])
