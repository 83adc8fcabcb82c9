"""Speculative decoding configuration, in vLLM's `speculative_config` shape, and the choices and defaults that
`LLM`, the CLI and the server share (weight formats, the prefix cache's bound, the prefill chunk size)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

Method = Literal["ngram", "suffix", "draft", "eagle", "medusa"]
METHODS: tuple[str, ...] = ("ngram", "suffix", "draft", "eagle", "medusa")
SUFFIX_SCOPES: tuple[str, ...] = ("global", "key", "request")
"""Whose earlier answers a request's lookups read: every request's of the server, its tenant's (its cache_salt),
or none (only its own text)."""
NEEDS_MODEL = {"draft": "the draft model to run"}
"""Methods that cannot run without "model" (a head method without one uses the head shipped for the target)."""
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int8-dynamic", "int4", "gguf")
"""Weight formats a user may pick for a target (`LLM(quantization=...)`, `--quantization`) or a draft. "gguf": a
GGUF's own blocks, kept at load (`specdecode.model.gguf_model`)."""
TARGET_QUANTIZATIONS: tuple[str, ...] = ("auto", *QUANTIZATIONS)
"""A target's choices: "auto" (the default) is resolved at load (`specdecode.model.load.resolve_quantization`)."""
DRAFT_QUANTIZATIONS: tuple[str, ...] = ("auto", *QUANTIZATIONS, "int4-hybrid", "q8_0")
"""Draft weight formats: QUANTIZATIONS ("gguf": a .gguf draft's own blocks),
"int4-hybrid" (int4 for a few tokens, bf16 for prefill), "q8_0" (llama.cpp's Q8_0 blocks on the GGUF kernels)
and "auto" (the CPU's fastest single-token path)."""
DRAFT_VOCAB_SIZE = 32768
"""A draft model's default draft vocabulary (`SpeculativeConfig.draft_vocab_size`)."""
DEFAULT_POOL_GB = 1.0
"""Memory bound of the prefix cache's pool (`LLM(prefix_cache_gb=)`, `--prefix-cache-gb`)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
"""Prompt tokens per step while others decode: on a CPU a chunk this long costs a few decode steps."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: Method
    """Which proposer drafts tokens: "ngram" (prompt lookup), "suffix" (a tree of what followed the suffix in the
    request's own text and in earlier answers), "draft" (a small model), "eagle" (a head
    on the target's hidden states, drafting a dynamic tree) or "medusa" (K heads, a tree of their top tokens)."""
    num_speculative_tokens: int | Literal["auto"] = "auto"
    """Draft length k; "auto" picks k each step from live acceptance and measured cost."""
    model: str | None = None
    """Draft model (alias, .gguf file or HF directory) for "draft"; the head directory (from
    `specdecode train-head`) for "eagle" and "medusa" (default: the head shipped for the target)."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram the n-gram proposer and the suffix lookups match."""
    prompt_lookup_max: int = 5
    """Longest suffix n-gram tried first."""
    max_speculative_tokens: int | None = None
    """Upper bound on k when num_speculative_tokens is "auto". None = the method's default: 16 for "suffix" (its
    guesses of copied text run long and cost no drafting), 8 otherwise."""
    draft_prompt_lookup: bool = True
    """Use lookup guesses beside the drafter: the suffix source's (the most frequent continuation of the text's
    longest matched suffix, of prompt_lookup_min to 16 tokens, in the request and in earlier answers of its
    suffix_scope). Draft-model chains: the guesses ride along in the draft's forwards (a run the draft would have
    drafted anyway costs one forward). Trees (draft model, EAGLE, Medusa): the guess is grafted onto the tree as
    one more branch. Every drafter: a step verifies the guess alone (the drafter not run) when that promises more
    tokens per second than drafting."""
    suffix_scope: str = "global"
    """Whose earlier answers the suffix lookups read (SUFFIX_SCOPES): "global" (every request of this server or
    `LLM`), "key" (requests with the same cache_salt), "request" (none: the request's own text only)."""
    suffix_cache_tokens: int = 1 << 17
    """Tokens of earlier answers kept for suffix lookups, over every scope (least recently added evicted; at most
    about 1 KB each)."""
    draft_dtype: str = "auto"
    """Precision of the draft model ("auto" = the target's); it never changes the output, only speed."""
    draft_tree_width: int | None = None
    """Nodes kept per tree level; 1 proposes a chain, > 1 a tree verified with tree attention in one
    target pass (top-b expansion, best cumulative draft probability kept per level); 0 = dynamic: the
    node budget spread over the depth, where the node budget is the largest target forward the measured
    cost model finds nearly as cheap as one token (at least 2 a level). None = the method's default: a chain
    for "draft", dynamic for "eagle" and "medusa"."""
    draft_tree_branching: int | None = None
    """Tree proposers: top-b candidates expanded per kept node. None = the method's default: 4 for "eagle" (an
    EAGLE head's runners-up are worth a place among the level's candidates, and candidates cost nothing until
    kept), 2 for "draft" and "medusa"."""
    draft_vocab_size: int | None = None
    """Draft model: the ids its output matrix keeps rows for (`specdecode.model.output_rows`): the tokenizer's
    lowest draft_vocab_size ids (byte-level BPE's most frequent pieces) and its added tokens. 0 = every id;
    None = DRAFT_VOCAB_SIZE. A draft proposes nothing outside them; the output never changes."""
    quantization: str = "auto"
    """Draft weight format (DRAFT_QUANTIZATIONS): "auto" takes the CPU's fastest single-token path for a bf16
    draft (`specdecode.model.fast_linear.draft_linear_format`) and keeps the weights otherwise."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 32):
            raise ValueError(f"num_speculative_tokens must be 'auto' or an integer in [0, 32], got {k!r}")
        if self.max_speculative_tokens is not None and not 1 <= self.max_speculative_tokens <= 32:
            raise ValueError(f"max_speculative_tokens must be in [1, 32], got {self.max_speculative_tokens}")
        if self.method in NEEDS_MODEL and not self.model:
            raise ValueError(f'method "{self.method}" needs "model": {NEEDS_MODEL[self.method]}')
        width = self.draft_tree_width
        branching = self.draft_tree_branching
        if (width is not None and not 0 <= width <= 16) or (branching is not None and not 1 <= branching <= 8):
            raise ValueError(
                f"draft_tree_width must be null or in [0, 16] and draft_tree_branching in [1, 8], got "
                f"{self.draft_tree_width} and {self.draft_tree_branching}"
            )
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int)
                                                  or isinstance(self.draft_vocab_size, bool)
                                                  or self.draft_vocab_size < 0):
            raise ValueError(f"draft_vocab_size must be null or an integer >= 0, got {self.draft_vocab_size!r}")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope must be one of {', '.join(SUFFIX_SCOPES)}, got {self.suffix_scope!r}")
        if not isinstance(self.suffix_cache_tokens, int) or self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be an integer >= 0, got {self.suffix_cache_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def k_max(self) -> int:
        k = self.num_speculative_tokens
        if k != "auto":
            return int(k)
        if self.max_speculative_tokens is not None:
            return self.max_speculative_tokens
        return 16 if self.method == "suffix" else 8

    @property
    def tree_width(self) -> int:
        """Configured nodes per level; 0 = dynamic (from the node budget)."""
        if self.draft_tree_width is not None:
            return self.draft_tree_width
        return 1 if self.method == "draft" else 0

    @property
    def tree_branching(self) -> int:
        """Configured top-b expansion per tree node, or the method's default."""
        if self.draft_tree_branching is not None:
            return self.draft_tree_branching
        return 4 if self.method == "eagle" else 2

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Accept a config object, a dict, or a JSON string (the CLI's --speculative-config)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            value = {**value, "method": "draft" if value.get("model") else "ngram"}
        return cls(**value)
