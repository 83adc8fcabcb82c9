"""Routing decisions of the cluster, as plain functions (no Ray import): the conversation key of a request,
rendezvous (highest-random-weight) hashing of keys onto replicas, the ranked replica choice with a
load-aware fallback, and the check whether a streamed chunk carries output yet.

Rendezvous hashing is consistent hashing without a ring: a key's replica is the one with the highest
hash of (key, replica id), so when a replica joins or leaves only the keys that go to (or came from)
it move; every other conversation keeps its replica, and with it its prefix cache and n-gram history.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

SESSION_HEADERS = ("x-session-id", "x-specdecode-session")
"""Request headers whose value pins a conversation (checked first, in this order)."""
DEFAULT_PREFIX_CHARS = 1024
"""Characters (or prompt tokens, for token-id prompts) of the conversation prefix that make its key."""


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def routing_key(body: Any, headers: Mapping[str, str] | None = None,
                prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """The affinity key of a request, or None when it has none (it then goes to the least loaded replica).

    In order: a session header (`X-Session-ID`), the OpenAI `user` field, and else the conversation
    prefix: for chat, the messages up to and including the first user message (system prompt + opening
    question: the same for every turn of one conversation, different between conversations that share
    only a system prompt), for completions the prompt; either cut to its first `prefix_chars` characters
    (or tokens, for a token-id prompt). The key is a hash, so nothing of the prompt is kept.
    """
    raw: str | None = None
    headers = headers or {}
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            raw = f"session\x00{value}"
            break
    if raw is None and isinstance(body, dict):
        user = body.get("user")
        messages = body.get("messages")
        prompt = body.get("prompt")
        if isinstance(user, str) and user:
            raw = f"user\x00{user}"
        elif isinstance(messages, list) and messages:
            parts = []
            for m in messages:
                if not isinstance(m, dict):
                    continue
                parts.append(f"{m.get('role')}\x00{_message_text(m.get('content'))}\x00")
                if m.get("role") == "user":
                    break
            raw = "chat\x00" + "".join(parts)[:prefix_chars]
        elif prompt is not None:
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, str) and prompt:
                raw = "text\x00" + prompt[:prefix_chars]
            elif isinstance(prompt, list) and prompt:
                raw = "tokens\x00" + ",".join(str(t) for t in prompt[:prefix_chars])
    if raw is None:
        return None
    return hashlib.sha1(raw.encode("utf-8", "surrogatepass")).hexdigest()


def _weight(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest(), "big")


def rendezvous_order(key: str, replicas: Sequence[T], id_of: Callable[[T], str]) -> list[T]:
    """`replicas` from the key's first choice to its last (highest random weight first)."""
    return sorted(replicas, key=lambda r: (_weight(key, id_of(r)), id_of(r)), reverse=True)


def rank_replicas(key: str | None, replicas: Sequence[T], id_of: Callable[[T], str],
                  load_of: Callable[[T], int | None], saturation: int, avoid: str | None = None) -> list[list[T]]:
    """Ranks of replicas to try, best first (Ray Serve takes the least loaded replica with room of a rank).

    With a key: [[its replica]] while that replica holds fewer than `saturation` requests, then every other
    replica (the load-aware fallback), then its replica again (better queued there than nowhere). Without
    one: all replicas at once. `avoid` (a replica that just failed this request) comes last, if at all.
    """
    usable = [r for r in replicas if id_of(r) != avoid]
    avoided = [r for r in replicas if id_of(r) == avoid]
    if not usable:
        return [avoided] if avoided else []
    if key is None:
        ranks = [usable]
    else:
        ordered = rendezvous_order(key, usable, id_of)
        primary, rest = ordered[0], ordered[1:]
        load = load_of(primary)
        ranks = []
        if load is None or load < saturation:
            ranks.append([primary])
        if rest:
            ranks.append(rest)
        ranks.append([primary])
    if avoided:
        ranks.append(avoided)
    return ranks


def carries_output(chunk: bytes) -> bool:
    """Whether a response chunk shows the client anything of the answer: for SSE, an event with text, a
    finish reason, an error or [DONE] (a chat stream's opening role chunk does not count); any non-SSE
    chunk counts. Until a chunk that counts arrives the request may still be retried on another replica."""
    found_event = False
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        found_event = True
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return True
        try:
            obj = json.loads(payload)
        except ValueError:
            return True
        if not isinstance(obj, dict) or "error" in obj:
            return True
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                return True
            delta = choice.get("delta") or {}
            if choice.get("text") or choice.get("finish_reason") or (isinstance(delta, dict) and delta.get("content")):
                return True
    return not found_event
