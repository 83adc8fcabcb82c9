"""Start-up measurement of the engine's one cost model: target forwards over t tokens in all, as one row
(a request's chain or tree) and as several rows (a batch), plus the drafter's step and catch-up costs."""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.engine.adaptive import CostModel
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import BatchProposer
from specdecode.tree import MAX_TREE_NODES


def _forward(target: Transformer, cache, rows: int, tokens: int, start: int) -> None:  # noqa: ANN001
    dev = target.device
    ids = torch.ones(rows, tokens, dtype=torch.long, device=dev)
    pos = torch.arange(start, start + tokens, device=dev).expand(rows, tokens)
    target.compute_logits(target(ids, pos, cache.rows(0, rows)))


def measure_cost(target: Transformer, proposer: BatchProposer | None, k_max: int, max_len: int, max_rows: int = 1,
                 context: int = 128, repeats: int = 3, flat: bool = False) -> CostModel:
    """Time forwards over 1..k_max+1 tokens of one row (up to a whole tree for tree proposers) and over
    rows x (1, 2, 4, k_max + 1) tokens for up to max_rows rows; the fastest shape per total counts.

    `flat` keeps only the 1-token time and prices every larger forward the same, as on a GPU whose
    forward of a 1.5B model stays memory-bound up to the largest tree: the benchmark uses it to show
    the trees (and τ) such hardware would choose, on a CPU where they are too slow to pay."""
    tree = proposer is not None and proposer.capabilities.trees
    top = MAX_TREE_NODES + 1 if tree else k_max + 1
    wanted = {1, 2, 3, 4, 6, 8, k_max + 1} | ({12, 16, 24, 32, 48, top} if tree else set())
    ts = sorted(t for t in wanted if t <= top)
    # A short max_len leaves less room: shrink the context, then drop the t that do not fit after it.
    context = max(0, min(context, max_len - top - 1))
    ts = [t for t in ts if context + t <= max_len] or [1]
    widths = sorted(w for w in {1, 2, 4, k_max + 1} if context + w <= max_len)
    batches = sorted({2, 4, 8, 16, max_rows} & set(range(2, max_rows + 1)))
    shapes = [(1, t) for t in ts] + ([] if flat else [(b, w) for b in batches for w in widths])
    cache = target.new_cache(max(1, max_rows if batches else 1), context + max(ts) + 1)
    if context:
        _forward(target, cache, cache.batch_size, context, 0)  # warm-up and a realistic cache
    timed = shapes[:1] if flat else shapes  # a flat curve needs only the 1-token time
    samples: dict[tuple[int, int], list[float]] = {s: [] for s in timed}
    for _ in range(repeats):  # rounds over every shape: a slow spell of a shared machine slows all alike,
        for rows, t in timed:  # so the ratios that choose k and the tree stay right
            t0 = time.perf_counter()
            _forward(target, cache, rows, t, context)
            samples[(rows, t)].append(time.perf_counter() - t0)
    points: dict[int, float] = {}
    for (rows, t), s in samples.items():
        points[rows * t] = min(points.get(rows * t, float("inf")), statistics.median(s))
    # A forward over more tokens never costs less: a slow spell during one sample must not make a larger
    # forward look cheaper than a smaller one (the lower envelope from above).
    lowest = float("inf")
    for t in sorted(points, reverse=True):
        lowest = points[t] = min(points[t], lowest)
    if flat:
        points = dict.fromkeys(ts, points[1])
    draft = proposer.step_cost_hint() if proposer is not None else 0.0
    catch_up = proposer.catch_up_token_seconds() if proposer is not None and proposer.capabilities.catch_up else 0.0
    return CostModel.from_points(points, max(points), draft_step_seconds=draft, catch_up_token_seconds=catch_up)
