"""A draft model for llama-cpp-python's speculative interface (`Llama(draft_model=...)`).

llama-cpp-python ships only prompt lookup as a drafter; its `LlamaDraftModel` interface takes the
context so far and returns guessed tokens. This one asks a second, small `Llama` for its greedy
continuation, reusing the drafter's KV cache for the prefix it shares with the new context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

DRAFT_TOKENS = 4
"""Tokens drafted per target step: about what our adaptive k settles on for the Qwen pair."""


class LlamaDraftLlama:
    def __init__(self, drafter: Any, num_pred_tokens: int, stop: set[int],
                 last_logits: Callable[[Any], np.ndarray] | None = None) -> None:
        self.drafter = drafter
        self.num_pred_tokens = num_pred_tokens
        self.stop = stop
        self.last_logits = last_logits or _last_logits

    def _next_token(self) -> int:
        return int(self.last_logits(self.drafter).argmax())

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        d = self.drafter
        ids = input_ids.tolist()
        have = d.input_ids[: d.n_tokens].tolist()
        shared = 0
        limit = min(len(have), len(ids) - 1)  # at least one token is evaluated, so logits are fresh
        while shared < limit and have[shared] == ids[shared]:
            shared += 1
        d.n_tokens = shared  # eval() drops the drafter's cache beyond this point
        d.eval(ids[shared:])
        out: list[int] = []
        while len(out) < self.num_pred_tokens:
            tok = self._next_token()
            out.append(tok)
            if tok in self.stop or len(out) == self.num_pred_tokens:
                break
            d.eval([tok])
        return np.array(out, dtype=np.intc)


def _last_logits(llm: Any) -> np.ndarray:
    """Logits [vocab] of the last evaluated token (a view of llama.cpp's buffer)."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
