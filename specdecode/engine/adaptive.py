"""Adaptive draft length: pick k each step from live acceptance and measured cost.

A step with draft length k costs ``CostModel.step_seconds(k)`` and emits
``AcceptanceTracker.expected_tokens(k)`` tokens on average; ``choose_k`` maximises the
ratio (tokens per second). k = 0 is plain decoding (one token per target forward), so a
useless proposer falls back to plain speed instead of slowing generation down.
"""

from __future__ import annotations

import math

from specdecode.cost_model import CostModel

DEFAULT_PRIOR = 0.6
"""α before any observation when nothing better is known: optimistic enough to try drafting, near the acceptance
of a typical draft model. `RequestHistory` replaces it by the measured acceptance of earlier requests."""


class AcceptanceTracker:
    """Per-request estimate of α_i = P(accept position i | positions 0..i-1 accepted).

    Each position keeps an exponential moving average of its accept (1) / reject (0)
    observations: ``α_i <- decay * α_i + (1 - decay) * x``. ``decay = 0.9`` remembers about
    the last 10 observations, so the estimate follows a change of text (prose -> code)
    within a few steps while one unlucky step moves it by only 10%. Before any
    observation, α_0 is ``prior`` (``DEFAULT_PRIOR``, or what earlier requests of the
    same pair measured: engine/history.py). A position never observed yet takes the
    estimate of the deepest observed position: acceptance at depth i is about as likely
    as at depth i-1, and a prior there would stall k below its best value (position k is
    only ever observed once k+1 tokens are drafted). Its first observation starts its own
    average from that borrowed value.

    With ``per_position=False`` every position shares one average, which each observed position
    updates in turn: a prompt-lookup guess copies text, which is kept or not alike at any depth.
    """

    def __init__(self, prior: float = DEFAULT_PRIOR, decay: float = 0.9, *, per_position: bool = True) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must lie in [0, 1], got {prior}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay}")
        self.prior = prior
        self.decay = decay
        self.per_position = per_position
        self._alpha: list[float] = []  # [num observed positions, or 1 shared]: EMA per position

    def alpha(self, i: int) -> float:
        """Estimated conditional acceptance probability at draft position i (0-based)."""
        if i < len(self._alpha):
            return self._alpha[i]
        return self._alpha[-1] if self._alpha else self.prior

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record one step: positions 0..a-1 accepted, a rejected if a < drafted, rest unseen."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted ({num_accepted}) <= num_drafted ({num_drafted})")
        observed = min(num_drafted, num_accepted + 1)  # positions with an accept/reject outcome
        while len(self._alpha) < (observed if self.per_position else min(observed, 1)):
            self._alpha.append(self.alpha(len(self._alpha)))  # start from the borrowed value
        d = self.decay
        for i in range(observed):
            x = 1.0 if i < num_accepted else 0.0
            j = i if self.per_position else 0
            self._alpha[j] = d * self._alpha[j] + (1.0 - d) * x

    def reach(self, k: int) -> float:
        """P(draft positions 0..k-1 all accepted): the chance a node after the first k is verified at all."""
        return math.prod(self.alpha(j) for j in range(k))

    def expected_tokens(self, k: int) -> float:
        """Expected output tokens of a step with draft length k (accepted + recovered/bonus).

        = 1 + sum_{i=1..k} prod_{j=0..i-1} α_j: position i-1 contributes a token only if
        every position before it was accepted; the final 1 is the recovered or bonus token.
        """
        total, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.alpha(j)  # P(positions 0..j all accepted)
            total += reach
        return total


def choose_k(tracker: AcceptanceTracker, cost: CostModel, k_max: int) -> int:
    """argmax over k in 0..k_max of expected tokens per second; ties go to the smaller k."""
    best_k, best_rate = 0, tracker.expected_tokens(0) / cost.step_seconds(0)
    total, reach = 1.0, 1.0
    for k in range(1, max(0, k_max) + 1):
        reach *= tracker.alpha(k - 1)
        total += reach  # == tracker.expected_tokens(k), incrementally
        rate = total / cost.step_seconds(k)
        if rate > best_rate * (1.0 + 1e-9):  # relative margin: float noise is a tie
            best_k, best_rate = k, rate
    return best_k


_PERFECT = AcceptanceTracker(prior=1.0)
"""A drafter whose every draft is accepted (never updated)."""


class AdaptiveK:
    """Draft-length policy of one request: adaptive (tracker + cost model) or fixed.

    Exploration: once a row drafts nothing, the tracker stops getting observations and could
    never learn that the proposer became useful (an n-gram proposer when the text turns
    repetitive). So after ``probe_interval`` consecutive steps that drafted nothing we probe
    once with k = 1. The streak counts what the step drafted (``observe``), after the batch's
    cap: a row whose own choice is k > 0 but which the batch keeps at k = 0 learns nothing
    either, and probes too. A rejected probe doubles the interval (16, 32, 64 =
    ``max_probe_interval``), so a useless proposer pays for at most 1 probe in 65 steps, while
    a proposer that turns useful is noticed within 65 steps; an accepted probe resets the
    interval. A probe also feeds the tracker, so a useless drafter's α_0 keeps falling and k
    stays 0. In a batch the cap may defer a probe that does not pay (engine/schedule.py), by
    at most one interval per row of the batch: then the probe is due (``probe_due``) and runs whatever it costs
    (every row's due probes together cost the batch about what one lone row's cost it); meanwhile it runs with
    any step whose forward is wider than a token a row anyway.
    A probe that the row's lookup guess replaces (engine/lookup_guess.py) starts a new interval;
    a drafter that would not pay even with every draft accepted is never probed.
    """

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        fixed_k: int | None = None,
        prior: float = DEFAULT_PRIOR,
        decay: float = 0.9,
        probe_interval: int = 16,
        max_probe_interval: int = 64,
    ) -> None:
        if fixed_k is None and cost is None:
            raise ValueError("AdaptiveK needs a cost model, or fixed_k for a fixed draft length")
        if fixed_k is not None and fixed_k < 0:
            raise ValueError(f"fixed_k must be >= 0, got {fixed_k}")
        if not 1 <= probe_interval <= max_probe_interval:
            raise ValueError(
                f"need 1 <= probe_interval ({probe_interval}) <= max_probe_interval ({max_probe_interval})"
            )
        self.cost = cost  # mutable: the engine may swap in a re-measured model
        self.fixed_k = fixed_k
        self.tracker = AcceptanceTracker(prior, decay)
        self.base_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_interval = probe_interval
        self.observed_positions = 0
        """Draft positions with an accept / reject outcome so far (the tracker's observations)."""
        self.accepted_positions = 0
        """Of those, the accepted ones: their ratio is the request's acceptance, which `RequestHistory` pools."""
        self._zero_streak = 0  # consecutive observed steps that drafted nothing (after the batch cap)
        self._probing = False  # the last next_k() was a probe
        self._forced = False  # the last next_k() was a forced plain step (no room to draft)

    def next_k(self, k_max_allowed: int) -> int:
        """Draft length for the next step, never above ``k_max_allowed`` (see cap_draft_len)."""
        k_max_allowed = max(0, k_max_allowed)
        if self._probing:  # the last probe was never observed: the row's lookup guess ran instead; wait anew
            self._zero_streak = 0
        self._probing = self._forced = False
        if self.fixed_k is not None:
            return min(self.fixed_k, k_max_allowed)
        if k_max_allowed == 0:
            self._forced = True  # says nothing about the proposer: leaves the streak alone
            return 0
        assert self.cost is not None
        k = choose_k(self.tracker, self.cost, k_max_allowed)
        # A drafter too slow to pay even if every draft were accepted has nothing to learn from a probe.
        if self._zero_streak >= self.probe_interval and choose_k(_PERFECT, self.cost, k_max_allowed) > 0:
            self._probing = True
            return 1
        return k

    @property
    def probing(self) -> bool:
        """The last next_k() was a probe (k = 1 after a run of steps that drafted nothing)."""
        return self._probing

    def probe_due(self, rows: int = 1) -> bool:
        """The last next_k() was a probe that a batch of `rows` rows has deferred for `rows` intervals already: it
        runs now. A probe widens the whole batch's forward, so a batch probes about as often as one row alone."""
        return self._probing and self._zero_streak >= (1 + max(1, rows)) * self.probe_interval

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Feed back one step's outcome (the proposer may have drafted fewer than k, the batch may have cut k)."""
        self.tracker.update(num_drafted, num_accepted)
        self.observed_positions += min(num_drafted, num_accepted + 1)
        self.accepted_positions += num_accepted
        if num_drafted > 0:
            self._zero_streak = 0
        elif not self._forced:
            self._zero_streak += 1
        if self._probing and num_drafted > 0:
            if num_accepted > 0:
                self.probe_interval = self.base_probe_interval
            else:
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        self._probing = self._forced = False
