"""What earlier requests of one (target, drafter) pair say about the next: how often its drafts are accepted (the
prior of a new row's draft-length policy, measured rather than assumed) and how many tokens a request produces (the
horizon a draft's catch-up is spread over). One per `LLM`, shared by its engines; the cost cache
(engine/cost_cache.py) keeps it across processes, beside the measured costs of the same set-up.

Decisions read the values known when the history was made (what earlier processes measured), never the running
ones: the draft lengths of a seeded sampled request, and with them the random numbers it draws, are the same on
every call of one `LLM`. The requests it runs update the running values, which the next process starts from."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from specdecode.engine.adaptive import DEFAULT_PRIOR, AdaptiveK
from specdecode.engine.schedule import CATCH_UP_HORIZON_TOKENS
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingParams

MEMORY = 64
"""The running means weigh about the last this many requests, so they follow a change of workload."""
PRIOR_WEIGHT = 2.0
"""Requests' worth of the assumed values (DEFAULT_PRIOR, CATCH_UP_HORIZON_TOKENS) blended into the measured means,
so that one odd request moves them little."""


def runs_to_max_tokens(params: SamplingParams) -> bool:
    """Nothing but max_tokens ends the request (EOS ignored, no stop, no grammar): its length is known."""
    return (params.ignore_eos and not params.stop and not params.stop_token_ids
            and params.structured_outputs is None)


class RequestHistory:
    """Running means over finished requests: the acceptance of their drafts (accepted over observed draft
    positions, the quantity `AcceptanceTracker` estimates per position) and their output tokens, starting from a
    saved `state`. `on_change` receives `state()` after every request that changed it (the cost cache writes it to
    disk)."""

    def __init__(self, state: Mapping[str, Any] | None = None, *,
                 on_change: Callable[[dict[str, float]], None] | None = None) -> None:
        self.on_change = on_change
        self.acceptance, self.acceptance_requests = DEFAULT_PRIOR, 0
        self.output_tokens, self.length_requests = float(CATCH_UP_HORIZON_TOKENS), 0
        if state:
            self._restore(state)
        self._prior = _blend(self.acceptance, self.acceptance_requests, DEFAULT_PRIOR)
        self._length = _blend(self.output_tokens, self.length_requests, CATCH_UP_HORIZON_TOKENS)

    def prior(self) -> float:
        """α of a new row before it drafts: the mean acceptance earlier processes measured, DEFAULT_PRIOR before
        any request."""
        return self._prior

    def expected_length(self, params: SamplingParams) -> float:
        """Output tokens a request with `params` is expected to produce: max_tokens where nothing else ends it, else
        the mean of the requests earlier processes ran (CATCH_UP_HORIZON_TOKENS before any)."""
        if runs_to_max_tokens(params):
            return float(params.max_tokens)
        return self._length

    def finished(self, policy: AdaptiveK | None, seq: Sequence) -> None:
        """Learn from a request that left its row (one aborted or failed says nothing of its length)."""
        if seq.finish_reason not in ("stop", "length"):
            return
        changed = False
        if policy is not None and policy.observed_positions > 0:
            self.acceptance_requests += 1
            rate = policy.accepted_positions / policy.observed_positions
            self.acceptance += (rate - self.acceptance) / min(self.acceptance_requests, MEMORY)
            changed = True
        if not runs_to_max_tokens(seq.params):
            self.length_requests += 1
            self.output_tokens += (seq.num_output - self.output_tokens) / min(self.length_requests, MEMORY)
            changed = True
        if changed and self.on_change is not None:
            self.on_change(self.state())

    def state(self) -> dict[str, float]:
        return {"acceptance": self.acceptance, "acceptance_requests": self.acceptance_requests,
                "output_tokens": self.output_tokens, "length_requests": self.length_requests}

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Take a saved state's values that make sense (a damaged file costs the measured values, nothing more)."""
        acceptance, n = state.get("acceptance"), state.get("acceptance_requests")
        if _number(acceptance) and 0.0 <= acceptance <= 1.0 and _count(n):
            self.acceptance, self.acceptance_requests = float(acceptance), int(n)
        tokens, n = state.get("output_tokens"), state.get("length_requests")
        if _number(tokens) and tokens >= 0 and _count(n):
            self.output_tokens, self.length_requests = float(tokens), int(n)


def _blend(mean: float, requests: int, assumed: float) -> float:
    n = min(requests, MEMORY)
    return (n * mean + PRIOR_WEIGHT * assumed) / (n + PRIOR_WEIGHT)


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
