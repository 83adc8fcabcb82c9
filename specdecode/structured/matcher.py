"""The grammar engine behind structured outputs: llguidance, wrapped as a `TokenMatcher`.

A matcher follows one request's output token by token: `allowed()` is the mask of tokens the grammar
accepts next (EOS only where the output so far is complete), `consume` advances it, `rollback` undoes the
last tokens (the engine walks a draft tree with consume/rollback and keeps only committed tokens).
llguidance is imported here only, on the first constrained request (the `serve` extra installs it).

Grammars are compiled under limits lower than llguidance's defaults (`LIMITS`), and the last few compiled are
kept: a request with a grammar seen before, or the other choices of an `n` > 1 request, start from a copy
instead of compiling again. The server compiles on a grammar thread (`compiled_grammar`), so that the sequence
built on the event loop (`build_matcher`) only copies.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from specdecode.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from specdecode.model.tokenizer import Tokenizer


class TokenMatcher(Protocol):
    """What the engine needs of a grammar: a token mask and a cursor it can move back."""

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar accepts next (never all False)."""

    def consume(self, token: int) -> bool:
        """Advance by one token; False if the grammar refuses it."""

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""

    def is_stopped(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (possibly none), as the tokenizer would write them."""


JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as `json.dumps` and chat templates write it: one space after ':' and ',', no other blank space (free
whitespace lets a model, or a random one, wander through runs of blanks)."""

LIMITS = {  # llguidance's defaults after each
    "initial_lexer_fuel": 250_000,  # 1,000,000: the lexer's work when the grammar is compiled
    "step_lexer_fuel": 100_000,  # 200,000: the lexer's work for one token mask
    "step_max_items": 20_000,  # 50,000: parser items for one token mask
    "max_lexer_states": 50_000,  # 250,000: lexer states one matcher builds (its memory)
    "max_grammar_size": 200_000,  # 500,000: symbols of the compiled grammar
}
"""llguidance's resource limits, below its defaults: a grammar past them is refused when compiled (a 400), and
a token mask past them ends the output (EOS) rather than stall the engine's step. `max_items_in_row` keeps its
default (2,000): a `choice` of up to 1,024 strings is one row."""
COMPILED_KEPT = 32
"""Compiled grammars kept per tokenizer, the least recently used dropped first."""

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_COMPILED: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[int, StructuredOutputsParams], Any]] = (
    weakref.WeakKeyDictionary())
_LOCK = threading.Lock()
"""Guards both caches: matchers are built on the server's grammar threads and on the event loop."""
_BUILD_LOCK = threading.Lock()
"""One tokenizer view is built at a time (the server's warm-up and a first constrained request may race)."""


def _import_llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # pragma: no cover - depends on the install
        raise ValueError("structured outputs need the grammar engine: pip install llguidance (or, in a specdecode "
                         "checkout, pip install -e '.[serve]')") from None
    return llguidance


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's view of the tokenizer over the model's vocab_size logits (built once, ~1 s; a second
    thread asking meanwhile waits for it)."""
    with _LOCK:
        cached = _TOKENIZERS.get(tokenizer)
    if cached is not None and cached[0] == vocab_size:
        return cached[1]
    with _BUILD_LOCK:
        cached = _TOKENIZERS.get(tokenizer)
        if cached is not None and cached[0] == vocab_size:
            return cached[1]
        llg = _import_llguidance()
        eos = tokenizer.eos_token_id
        lltok = llg.hf.from_tokenizer(tokenizer.hf, n_vocab=max(vocab_size, len(tokenizer.hf)), eos_token=eos)
        with _LOCK:
            _TOKENIZERS[tokenizer] = (vocab_size, lltok)
        return lltok


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint."""
    llg = _import_llguidance()
    kind = params.kind
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_STYLE)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", list(params.choice or ()))
    return llg.grammar_from("grammar", params.grammar or "")


class LLGuidanceMatcher:
    """A `TokenMatcher` over llguidance's `LLMatcher`."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        self._m = matcher

    def allowed(self) -> torch.Tensor:
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)  # [V]
        if not mask.any() and self.eos is not None:  # a matcher in error: end the output rather than emit NaNs
            mask[self.eos] = True
        return torch.from_numpy(mask)

    def consume(self, token: int) -> bool:
        # try_consume leaves a refused token unconsumed; consume_token would put the matcher in an error
        # state it never leaves (rollback included), and a drafted token may well be refused.
        return self._m.try_consume_tokens([int(token)]) == 1

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_stopped(self) -> bool:
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def forced(self) -> list[int]:
        return list(self._m.compute_ff_tokens())

    @property
    def error(self) -> str:
        return self._m.get_error()


def compile_grammar(params: StructuredOutputsParams, lltok: Any) -> Any:
    """llguidance's matcher of a constraint, at its start, compiled under `LIMITS`; raises ValueError on a
    grammar llguidance refuses (invalid, or past a limit). Releases the GIL while it compiles."""
    llg = _import_llguidance()
    try:
        grammar = grammar_text(params)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs: {exc}") from None
    matcher = llg.LLMatcher(lltok, grammar, log_level=0, limits=llg.LLParserLimits(**LIMITS))
    if matcher.is_error():
        raise ValueError(f"invalid grammar: {matcher.get_error()}")
    return matcher


def compiled_grammar(params: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int) -> Any:
    """The constraint's compiled matcher, at its start: the one kept, else compiled now and kept (never advance
    it: copy it); raises ValueError on a grammar the engine refuses."""
    key = (vocab_size, params)
    with _LOCK:
        kept = _COMPILED.setdefault(tokenizer, OrderedDict())
        compiled = kept.get(key)
        if compiled is not None:
            kept.move_to_end(key)
            return compiled
    compiled = compile_grammar(params, ll_tokenizer(tokenizer, vocab_size))
    with _LOCK:
        kept[key] = compiled
        while len(kept) > COMPILED_KEPT:
            kept.popitem(last=False)
    return compiled


def build_matcher(params: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int) -> LLGuidanceMatcher:
    """A fresh matcher for one request (a copy of the compiled grammar); raises ValueError on a grammar the
    engine refuses."""
    compiled = compiled_grammar(params, tokenizer, vocab_size)
    return LLGuidanceMatcher(compiled.deep_copy(), vocab_size, tokenizer.eos_token_id)
