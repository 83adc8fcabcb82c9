"""Method names of the benchmark (`plain`, `ngram`, `draft-k4`, `eagle-chain`, ...) and their configs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from specdecode.config import DRAFT_QUANTIZATIONS, QUANTIZATIONS

_METHOD_RE = re.compile(
    r"^(plain|ngram|suffix|draft|eagle|medusa)(-chain|-tree|-w\d+)?(?:-b(\d+))?(-nolookup)?(?:-v(\d+))?(?:-k(\d+))?$")
METHOD_HELP = ("plain, ngram, suffix, draft, eagle, medusa; -kN fixes k=N (else adaptive); -chain drafts a chain, "
               "-tree a dynamic tree (draft: chain by default; eagle/medusa: dynamic tree by default), -wN a tree "
               "keeping N nodes per level (e.g. eagle-w2-k4: at most 8 nodes, like the chain eagle-chain-k8), -bN "
               "expanding each tree node into its top N tokens (default 4 for eagle, 2 otherwise); "
               "-nolookup (draft, eagle, medusa) turns the prompt-lookup guesses off; -vN (draft) keeps the draft's "
               "output rows for its N lowest ids (-v0: every id; default 32768); "
               ":LABEL uses the head given as --head LABEL=DIR (eagle:v4; compares heads in one run) or the draft "
               "given as --draft LABEL=MODEL (draft:small); "
               "@FORMAT runs the target quantized (e.g. plain@int8-dynamic, draft@int4, plain@gguf: the GGUF's "
               "own blocks; default exact); "
               "~FORMAT sets the draft's or head's weight format (e.g. draft~int4-hybrid; default auto)")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    speculative_config: dict[str, Any] | None
    quantization: str = "none"
    """Target weight format for this method (the exact target by default)."""


def _suffix(name: str, sep: str, choices: tuple[str, ...], what: str) -> tuple[str, str]:
    """name split at `sep` into (method, suffix); a suffix outside `choices` is refused ("" when absent)."""
    base, _, value = name.partition(sep)
    if value and value not in choices:
        raise ValueError(f"unknown {what} {value!r} in {name!r}; use one of {', '.join(choices)}")
    return base, value


def parse_method(name: str, draft: str | None, heads: dict[str, str] | None = None) -> MethodSpec:
    """``plain``, ``ngram``, ``draft``, ``eagle``, ``medusa``, optionally ``-chain``/``-tree``, ``-kN`` and
    ``@FORMAT`` (target quantization)."""
    name = name.strip()
    base, quant = _suffix(name, "@", QUANTIZATIONS, "target format")
    if quant:
        spec = parse_method(base, draft, heads)
        return MethodSpec(name, spec.speculative_config, quant)
    base, draft_format = _suffix(name, "~", DRAFT_QUANTIZATIONS, "draft format")
    if draft_format:
        spec = parse_method(base, draft, heads)
        if spec.speculative_config is None:
            raise ValueError(f"method {name!r}: plain decoding has no draft to format")
        return MethodSpec(name, {**spec.speculative_config, "quantization": draft_format})
    name, _, label = name.partition(":")
    m = _METHOD_RE.match(name)
    if (m is None or (m.group(1) in ("plain", "ngram", "suffix") and (m.group(2) or m.group(3)))
            or (m.group(1) == "plain" and m.group(6))
            or (m.group(4) and m.group(1) not in ("draft", "eagle", "medusa"))
            or (m.group(5) and m.group(1) != "draft")):
        raise ValueError(f"unknown method {name!r}: {METHOD_HELP}")
    kind, shape, branching, nolookup, vocab, k = m.groups()
    if label and kind not in ("draft", "eagle", "medusa"):
        raise ValueError(f"method {name!r}: only draft, eagle and medusa take a label (:{label})")
    full_name = f"{name}:{label}" if label else name
    if kind == "plain":
        return MethodSpec(name, None)
    cfg: dict[str, Any] = {"method": kind, "num_speculative_tokens": int(k) if k is not None else "auto"}
    if kind == "draft":
        model = (heads or {}).get(f"draft:{label}") if label else draft
        if not model:
            raise ValueError(f"method {full_name!r} needs --draft {label + '=' if label else ''}MODEL")
        cfg["model"] = model
    if kind in ("eagle", "medusa"):
        key = f"{kind}:{label}" if label else kind
        head = (heads or {}).get(key)
        if not head:
            how = f"--head {label}=DIR" if label else "--head DIR"
            raise ValueError(f"method {full_name!r} needs {how} (a trained {kind} head)")
        cfg["model"] = head
    if shape is not None:
        widths = {"-chain": 1, "-tree": 0}
        cfg["draft_tree_width"] = widths[shape] if shape in widths else int(shape[2:])
    if branching is not None:
        cfg["draft_tree_branching"] = int(branching)
    if nolookup:
        cfg["draft_prompt_lookup"] = False
    if vocab is not None:
        cfg["draft_vocab_size"] = int(vocab)
    return MethodSpec(full_name, cfg)
