"""The constrain phase of a step (structured outputs), between propose and plan: each constrained row's
draft is walked with its grammar matcher, forbidden drafted tokens are cut before verification, and every
kept node gets its token mask (the tokens the grammar accepts after the path root..node), which verify
applies to the target's logits there.

Cutting is lossless. A point-mass node the grammar forbids (n-gram, greedy draft, tree candidates) would be
rejected for sure and its rejection leaves the residual unchanged (its masked target probability is 0), so
it and its subtree are dropped. A sampled chain's forbidden token is rejected for sure too, but the token
after it must come from the residual max(p - q, 0) of the draft distribution it was sampled from: the chain
keeps that token as its leaf (verify rejects it) and drops what follows.

A chain that the grammar kept whole is then extended by the grammar's forced continuation (the tokens that
must come next, e.g. a JSON schema's keys and punctuation), as point-mass draft nodes: free drafts that
the constrained target almost always accepts, verified like any other (lossless by the same rule).

A row whose matcher raises fails alone (engine/row_faults.py); the other rows are constrained as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.engine.adaptive import AcceptanceTracker
from specdecode.engine.plan import RowTree
from specdecode.engine.row_faults import guarded
from specdecode.engine.sequence import Sequence
from specdecode.structured.matcher import TokenMatcher
from specdecode.tree import MAX_TREE_NODES

FORCED_DRAFT_MAX = 16
"""Most grammar-forced tokens appended to a constrained row's chain in one step."""


def _children(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for c, p in enumerate(parents[1:], start=1):
        children[p].append(c)
    return children


def _walk_tree(row: RowTree, matcher: TokenMatcher) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Depth-first over the tree, consuming along each path and rolling back: the nodes the grammar allows
    (original indices) and each one's mask."""
    children = _children(row.parents)
    kept: list[int] = []
    masks: dict[int, torch.Tensor] = {}

    def visit(v: int) -> None:
        kept.append(v)
        masks[v] = allowed = matcher.allowed()  # [V]
        for c in children[v]:
            token = row.tokens[c]
            if bool(allowed[token]) and matcher.consume(token):
                visit(c)
                matcher.rollback(1)

    visit(0)
    return sorted(kept), masks


def _walk_sampled_chain(row: RowTree, matcher: TokenMatcher) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Along a sampled chain: up to the first forbidden token, which stays as a leaf with no mask of its
    own (it is always rejected, so its row is never read)."""
    kept, masks, consumed = [0], {}, 0
    for v in range(len(row.tokens)):
        masks[v] = allowed = matcher.allowed()  # [V]
        c = v + 1
        if c == len(row.tokens):
            break
        kept.append(c)
        if not bool(allowed[row.tokens[c]]) or not matcher.consume(row.tokens[c]):
            masks[c] = torch.ones_like(allowed)
            break
        consumed += 1
    matcher.rollback(consumed)
    return kept, masks


def _forced(row: RowTree, masks: list[torch.Tensor], matcher: TokenMatcher, room: int
            ) -> tuple[list[int], list[torch.Tensor]]:
    """The grammar's forced tokens after the chain `row` (up to `room`) and the mask after each."""
    for t in row.tokens[1:]:
        matcher.consume(t)
    tokens: list[int] = []
    extra: list[torch.Tensor] = []
    allowed = masks[-1]
    for t in matcher.forced()[:room]:
        if not bool(allowed[t]) or not matcher.consume(t):
            break
        tokens.append(t)
        allowed = matcher.allowed()
        extra.append(allowed)
    matcher.rollback(len(row.tokens) - 1 + len(tokens))
    return tokens, extra


def _extend(row: RowTree, tokens: list[int]) -> RowTree:
    """The chain with point-mass nodes appended (a sampled chain's rows for them are one-hot)."""
    n = len(row.tokens)
    probs = row.draft_probs
    if probs is not None:
        onehot = torch.zeros(len(tokens), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        probs = torch.cat([probs, onehot])  # [n + f, V]
        probs[n - 1 : n - 1 + len(tokens)] = 0.0
        probs[torch.arange(n - 1, n - 1 + len(tokens)), torch.tensor(tokens)] = 1.0
    parents = [*row.parents, *range(n - 1, n - 1 + len(tokens))]
    return RowTree([*row.tokens, *tokens], parents, probs, row.drafted, len(tokens))


def _trimmed(row: RowTree, drop: int) -> RowTree:
    """The chain without its last `drop` forced nodes."""
    n = len(row.tokens) - drop
    probs = None if row.draft_probs is None else row.draft_probs[:n].clone()
    if probs is not None:
        probs[n - 1] = 0.0  # the new leaf has no children
    return RowTree(row.tokens[:n], row.parents[:n], probs, row.drafted, row.forced - drop)


def fit_forced(rows: list[RowTree], masks: list[torch.Tensor | None], reach: list[float],
               forward_seconds: Callable[[int], float], base_tokens: float) -> None:
    """Trim the rows' forced tails (in place) to the batch width that yields the most tokens per second.

    Every row of the forward is padded to the widest, so one row's long forced tail costs every row its
    width. Width W (nodes per row) costs `forward_seconds(rows * W)` and yields `base_tokens` (the step's
    expected tokens without forced nodes) plus, per row, the forced nodes that fit within W, each worth
    `reach[i]` (the chance the row's drafted nodes before them are all accepted; a forced node itself is
    the constrained target's only choice).
    """
    core = [len(r.tokens) - r.forced for r in rows]
    low, high = max(core), max(len(r.tokens) for r in rows)
    if high == low:
        return

    def rate(width: int) -> float:
        gained = sum(p * min(r.forced, max(0, width - c)) for r, c, p in zip(rows, core, reach, strict=True))
        return (base_tokens + gained) / forward_seconds(len(rows) * width)

    width = max(range(low, high + 1), key=lambda w: (rate(w), -w))
    for i, r in enumerate(rows):
        drop = max(0, len(r.tokens) - width)
        if drop:
            rows[i] = _trimmed(r, drop)
            mask = masks[i]
            assert mask is not None  # forced nodes exist on constrained rows only
            masks[i] = mask[: len(r.tokens) - drop]


def constrain_row(row: RowTree, matcher: TokenMatcher, forced_room: int = 0) -> tuple[RowTree, torch.Tensor]:
    """The row's draft with forbidden tokens cut, and its masks [n', V] (bool, row v = allowed after node v);
    a chain kept whole gets up to `forced_room` forced tokens appended.

    The matcher stands after the row's pending token (node 0) and is left there.
    """
    sampled = row.draft_probs is not None
    kept, masks = (_walk_sampled_chain if sampled else _walk_tree)(row, matcher)
    rows = [masks[v] for v in kept]
    if len(kept) != len(row.tokens):
        index = {v: i for i, v in enumerate(kept)}
        parents = [-1, *(index[row.parents[v]] for v in kept[1:])]
        probs = None if row.draft_probs is None else row.draft_probs[kept]
        drafted = sum(1 for v in kept[1:] if v <= row.drafted)
        row = RowTree([row.tokens[v] for v in kept], parents, probs, drafted)
    elif forced_room > 0 and row.is_chain:
        tokens, extra = _forced(row, rows, matcher, forced_room)
        if tokens:
            row, rows = _extend(row, tokens), rows + extra
    return row, torch.stack(rows)  # [n', V]


def mask_logits(logits: torch.Tensor, offsets: list[int], masks: list[torch.Tensor | None]) -> torch.Tensor:
    """The grammar masks applied: logits [N, V] over every row's nodes, masks[i] bool [n_i, V] (None: row i
    is unconstrained) -> logits with forbidden tokens at -inf, so every processor and the rejection
    sampling (acceptance and residuals) see the constrained target distribution."""
    if all(m is None for m in masks):
        return logits
    out = logits.clone()
    for i, mask in enumerate(masks):
        if mask is not None:
            lo, hi = offsets[i], offsets[i + 1]
            out[lo:hi].masked_fill_(~mask.to(out.device), float("-inf"))
    return out


def constrain_rows(seqs: list[Sequence], trackers: list[AcceptanceTracker | None], rows: list[RowTree],
                   max_len: int, forward_seconds: Callable[[int], float] | None) -> list[torch.Tensor | None] | None:
    """The constrain phase: cut the drafted tokens each row's grammar forbids (rows edited in place) and return
    every row's token masks [n, V] (None for an unconstrained row; None if no row is).

    A row's tracker is None where it does not speculate; forced tokens ride along only where it does, within
    its context and tokens left, and with a measured `forward_seconds` the batch's forced tails are fitted to
    the width that pays.
    """
    if all(s.matcher is None for s in seqs):
        return None
    masks: list[torch.Tensor | None] = []
    for i, (seq, tracker) in enumerate(zip(seqs, trackers, strict=True)):
        if seq.matcher is None or seq.finished:  # finished: failed earlier in the step
            masks.append(None)
            continue
        room = 0
        if tracker is not None:
            n = len(rows[i].tokens)
            left = seq.params.max_tokens - seq.num_output
            context = max_len - len(seq.token_ids) - n
            room = max(0, min(FORCED_DRAFT_MAX, MAX_TREE_NODES - n, context, left - n))
        done = guarded(seq, "the grammar", constrain_row, rows[i], seq.matcher, room)
        if done is not None:
            rows[i] = done[0]
        masks.append(None if done is None else done[1])
    if forward_seconds is not None and len(rows) > 1 and any(r.forced for r in rows):
        reach, base = [], 0.0
        for tracker, row in zip(trackers, rows, strict=True):
            drafted = len(row.tokens) - row.forced - 1
            reach.append(tracker.reach(drafted) if tracker is not None else 1.0)
            base += tracker.expected_tokens(drafted) if tracker is not None else 1.0
        fit_forced(rows, masks, reach, forward_seconds, base)
    return masks
