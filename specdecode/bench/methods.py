"""Method names of the benchmark (`plain`, `ngram`, `draft-k4`, `eagle-chain`, ...) and their configs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_METHOD_RE = re.compile(r"^(plain|ngram|draft|eagle|medusa)(-chain|-tree)?(?:-k(\d+))?$")
METHOD_HELP = ("plain, ngram, draft, eagle, medusa; -kN fixes k=N (else adaptive); -chain drafts a chain, "
               "-tree a dynamic tree (draft: chain by default; eagle/medusa: dynamic tree by default)")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    speculative_config: dict[str, Any] | None


def parse_method(name: str, draft: str | None, heads: dict[str, str] | None = None) -> MethodSpec:
    """``plain``, ``ngram``, ``draft``, ``eagle``, ``medusa``, optionally ``-chain``/``-tree`` and ``-kN``."""
    m = _METHOD_RE.match(name.strip())
    if m is None or (m.group(1) in ("plain", "ngram") and m.group(2)) or (m.group(1) == "plain" and m.group(3)):
        raise ValueError(f"unknown method {name!r}: {METHOD_HELP}")
    kind, shape, k = m.groups()
    if kind == "plain":
        return MethodSpec("plain", None)
    cfg: dict[str, Any] = {"method": kind, "num_speculative_tokens": int(k) if k is not None else "auto"}
    if kind == "draft":
        if not draft:
            raise ValueError(f"method {name!r} needs --draft MODEL")
        cfg["model"] = draft
    if kind in ("eagle", "medusa"):
        head = (heads or {}).get(kind)
        if not head:
            raise ValueError(f"method {name!r} needs --head DIR (a trained {kind} head)")
        cfg["model"] = head
    if shape is not None:
        cfg["draft_tree_width"] = 1 if shape == "-chain" else 0
    return MethodSpec(name.strip(), cfg)
