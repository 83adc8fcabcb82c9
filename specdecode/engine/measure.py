"""Start-up measurement of the engine's one cost model: target forwards over t tokens in all, as one row
(a request's chain or tree) and as several rows (a batch), plus the drafter's step and catch-up costs. What it
measured can be saved (`record`) and given to a later process (`restore`: engine/cost_cache.py)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from specdecode.cost_model import CostModel
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import BatchProposer
from specdecode.tree import MAX_TREE_NODES


def _forward(target: Transformer, cache, rows: int, tokens: int, start: int) -> None:  # noqa: ANN001
    dev = target.device
    ids = torch.ones(rows, tokens, dtype=torch.long, device=dev)
    pos = torch.arange(start, start + tokens, device=dev).expand(rows, tokens)
    target.compute_logits(target(ids, pos, cache.rows(0, rows)))


class CostMeasurement:
    """The cost model measured as far as the calls so far needed: one row (a lone request's chain or tree) at
    first, then the shapes of a larger batch the first time a batch of that size runs.

    A call with one prompt never uses the batch shapes, so they wait for the first batch; they join the
    one-row points (each shape's median over its own rounds, the fastest shape per total tokens counting)."""

    def __init__(self, target: Transformer, proposer: BatchProposer | None, k_max: int, max_len: int,
                 context: int = 128, repeats: int = 3, flat: bool = False) -> None:
        self.target, self.proposer, self.k_max, self.max_len = target, proposer, k_max, max_len
        self.repeats, self.flat = repeats, flat
        tree = proposer is not None and proposer.capabilities.trees
        self.top = MAX_TREE_NODES + 1 if tree else k_max + 1
        wanted = {1, 2, 3, 4, 6, 8, k_max + 1} | ({12, 16, 24, 32, 48, self.top} if tree else set())
        ts = sorted(t for t in wanted if t <= self.top)
        # A short max_len leaves less room: shrink the context, then drop the t that do not fit after it.
        self.context = max(0, min(context, max_len - self.top - 1))
        self.ts = [t for t in ts if self.context + t <= max_len] or [1]
        self.widths = sorted(w for w in {1, 2, 4, k_max + 1} if self.context + w <= max_len)
        self.rows = 0
        """Rows measured so far (0: nothing yet)."""
        self.medians: dict[tuple[int, int], float] = {}
        """(rows, tokens per row) -> median seconds of that forward."""
        self.draft: tuple[float, float] | None = None
        """The proposer's (seconds per drafted token, seconds per catch-up token), measured once (None: not yet)."""
        self.restored = False
        """The costs came from an earlier process (`restore`): nothing was timed here."""

    def cost(self, rows: int) -> CostModel:
        """The cost model covering batches of up to `rows` rows (measuring what is missing)."""
        rows = max(1, rows)
        if self.rows == 0:
            self._time([(1, t) for t in (self.ts[:1] if self.flat else self.ts)], 1)
            self.rows = 1
        if rows > self.rows and not self.flat:  # a flat curve needs only the 1-token time
            # The cost model keys forwards by their total tokens: the largest batch at each width spans the
            # totals a batch runs, and smaller batches fall between the one-row and these points.
            self._time([(rows, w) for w in self.widths], rows)
            self.rows = rows
        return self._model()

    def _time(self, shapes: list[tuple[int, int]], rows: int) -> None:
        self.medians.update({s: statistics.median(v) for s, v in self._samples(shapes, rows, self.repeats).items()})

    def _samples(self, shapes: list[tuple[int, int]], rows: int, rounds: int) -> dict[tuple[int, int], list[float]]:
        """Seconds of each (rows, tokens) forward after the context, in `rounds` rounds over every shape."""
        target = self.target
        cache = target.new_cache(rows, self.context + max(t for _, t in shapes) + 1)
        if self.context:
            _forward(target, cache, 1, self.context, 0)  # warm-up and a realistic cache, copied to every row
            for row in range(1, rows):
                cache.copy_prefix(0, row, self.context)
        samples: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
        for _ in range(rounds):  # rounds over every shape: a slow spell of a shared machine slows all
            for b, t in shapes:  # alike, so the ratios that choose k and the tree stay right
                t0 = time.perf_counter()
                _forward(target, cache, b, t, self.context)
                samples[(b, t)].append(time.perf_counter() - t0)
        return samples

    def _model(self) -> CostModel:
        points: dict[int, float] = {}
        for (b, t), s in self.medians.items():
            points[b * t] = min(points.get(b * t, float("inf")), s)
        # A forward over more tokens never costs less: a slow spell during one sample must not make a larger
        # forward look cheaper than a smaller one (the lower envelope from above).
        lowest = float("inf")
        for t in sorted(points, reverse=True):
            lowest = points[t] = min(points[t], lowest)
        if self.flat:
            points = dict.fromkeys(self.ts, points[1])
        draft, catch_up = self._draft_costs()
        return CostModel.from_points(points, max(points), draft_step_seconds=draft, catch_up_token_seconds=catch_up)

    def _draft_costs(self) -> tuple[float, float]:
        if self.draft is None:
            p = self.proposer
            if p is None or p.capabilities.lookup:  # lookups draft for free: nothing to time
                self.draft = (0.0, 0.0)
                return self.draft
            before = self._one_token_seconds()
            step = p.step_cost_hint()
            catch_up = p.catch_up_token_seconds() if p.capabilities.catch_up else 0.0
            # What decides drafting is the draft's cost against the target's. Timed minutes apart on a shared
            # machine, a slow spell during one of them skews that ratio for every later process that reads the
            # cost cache; so the draft's times are taken relative to a target forward timed right around them.
            scale = 1.0
            if step > 0 and (1, 1) in self.medians:
                around = (before + self._one_token_seconds()) / 2
                scale = self.medians[(1, 1)] / around if around > 0 else 1.0
            self.draft = (step * scale, catch_up * scale)
        return self.draft

    def _one_token_seconds(self) -> float:
        """Median seconds of a one-token target forward after the context, timed now."""
        return statistics.median(self._samples([(1, 1)], 1, self.repeats)[(1, 1)])

    def record(self) -> dict[str, Any]:
        """What was measured, JSON-ready (for `restore` in a later process on the same machine and set-up)."""
        return {"rows": self.rows, "medians": [[b, t, s] for (b, t), s in sorted(self.medians.items())],
                "draft": list(self._draft_costs())}

    def restore(self, record: Any) -> bool:
        """Take a `record` of the same set-up as measured; False (nothing taken) where it is not a whole one."""
        try:
            rows, draft = record["rows"], tuple(float(x) for x in record["draft"])
            medians = {(int(b), int(t)): float(s) for b, t, s in record["medians"]}
        except (TypeError, KeyError, ValueError):
            return False
        whole = isinstance(rows, int) and rows >= 1 and len(draft) == 2 and all(
            math.isfinite(x) and x >= 0 for x in draft) and all(math.isfinite(s) and s > 0 for s in medians.values())
        # The one-row shapes every model starts from, and the batch shapes of the rows it claims.
        wanted = [(1, t) for t in (self.ts[:1] if self.flat else self.ts)]
        if rows > 1 and not self.flat:
            wanted += [(rows, w) for w in self.widths]
        if not whole or any(s not in medians for s in wanted):
            return False
        self.rows, self.medians, self.draft = rows, medians, (draft[0], draft[1])
        self.restored = True
        return True

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run each one-row forward shape of the target once, untimed: a process whose costs come from the cache
        would otherwise pay the first calls' costs (allocations, the native stack's build, first touches of
        scratch memory) in its first request, which then runs slower than later ones."""
        self._samples([(1, t) for t in self.ts], 1, 1)
