"""Continuous batching with speculation: one target forward verifies every running sequence.

Running sequences occupy cache rows 0..n-1 (a finished one's row is refilled by moving the
last row into it), so a step runs the target over a contiguous view of the cache. Each
sequence has its own proposer, draft length policy and metrics; draft lengths are ragged
and padded to the longest, and the batch-wide cap on k comes from the measured cost of a
forward over the whole batch, so speculation shrinks toward 0 under load.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.engine.adaptive import AdaptiveK, CostModel
from specdecode.engine.sequence import Sequence
from specdecode.engine.step_verify import share_hidden, start_sequence, verify_draft
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Draft, Proposer
from specdecode.proposers.ngram_match import cap_draft_len

STEP_LOG = os.environ.get("SPECDECODE_STEP_LOG")
"""A file to append one JSON line per batch step to (rows, chosen k, draft and step seconds)."""
CATCH_UP_HORIZON_STEPS = 16
"""Steps over which a draft's catch-up forward is amortised when deciding whether a row drafts."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the engine accepts; retry later."""


@dataclass
class Running:
    seq: Sequence
    proposer: Proposer | None
    policy: AdaptiveK | None
    k_override: int | None = None


@dataclass
class BatchCost:
    """Seconds of one target forward as a function of the total number of tokens in it."""

    points: tuple[tuple[int, float], ...]
    draft_step_seconds: float = 0.0
    catch_up_token_seconds: float = 0.0
    """Seconds per token a drafter spends catching up on context it has not seen (draft-model prefill)."""

    def forward_seconds(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (tokens - x1)

    def single_sequence_model(self, k_max: int) -> CostModel:
        return CostModel.from_points(
            {t: self.forward_seconds(t) for t in range(1, k_max + 2)}, k_max + 1, self.draft_step_seconds
        )


class BatchEngine:
    def __init__(
        self,
        target: Transformer,
        max_len: int,
        max_num_seqs: int = 8,
        max_waiting: int = 64,
        proposer_factory: Callable[[], Proposer] | None = None,
        k_max: int = 0,
        fixed_k: int | None = None,
    ) -> None:
        self.target = target
        self.max_len = max_len
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.proposer_factory = proposer_factory
        self.k_max = k_max if proposer_factory is not None else 0
        self.fixed_k = fixed_k
        # Headroom past max_len: padded draft positions of a full sequence write there harmlessly.
        self.cache = target.new_cache(max_num_seqs, max_len + self.k_max + 1)
        self.running: list[Running] = []
        self.waiting: deque[tuple[Sequence, int | None]] = deque()
        self.cost: BatchCost | None = None
        self.last_step_seconds = 0.0
        self._recent_rows: deque[int] = deque(maxlen=8)
        """Rows running or waiting at each of the last steps (tells a dip from a lower load)."""

    # ---- admission ------------------------------------------------------------------------------

    def add(self, seq: Sequence, k_override: int | None = None) -> None:
        """Queue a request; raises QueueFullError beyond max_waiting, ValueError if it can never fit."""
        need = seq.prompt_len + seq.params.max_tokens
        if need > self.max_len:
            raise ValueError(
                f"prompt ({seq.prompt_len} tokens) + max_tokens ({seq.params.max_tokens}) exceeds the context "
                f"length {self.max_len}"
            )
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting")
        self.waiting.append((seq, k_override))

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone); its row and KV are free for the next step."""
        for i, (seq, _) in enumerate(self.waiting):
            if seq.request_id == request_id:
                del self.waiting[i]
                seq._finish("abort")
                return True
        for i, r in enumerate(self.running):
            if r.seq.request_id == request_id:
                r.seq._finish("abort")
                self._release(i)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of cache slots holding live tokens."""
        used = sum(len(r.seq.token_ids) for r in self.running)
        return used / (self.max_num_seqs * self.max_len)

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq, k_override = self.waiting.popleft()
            row = len(self.running)
            proposer = self.proposer_factory() if self.proposer_factory is not None else None
            if k_override == 0:
                proposer = None
            if getattr(proposer, "tree_width", 1) != 1:
                # The batched verify pass is chain-only (ragged rows, causal masks): tree proposers draft
                # their best chain here; trees are verified in the single-sequence path.
                proposer.tree_width = 1  # type: ignore[union-attr]
            self._prefill(seq, row, proposer)
            self.running.append(Running(seq, proposer, self._policy(proposer, k_override), k_override))
            admitted.append(seq)
            if seq.finished:
                self._release(row)
        return admitted

    def _policy(self, proposer: Proposer | None, k_override: int | None) -> AdaptiveK | None:
        if proposer is None:
            return None
        fixed = k_override if k_override is not None else self.fixed_k
        if fixed is not None:
            return AdaptiveK(fixed_k=fixed)
        assert self.cost is not None, "measure_cost() must run before adaptive requests"
        return AdaptiveK(self.cost.single_sequence_model(self.k_max))

    def _prefill(self, seq: Sequence, row: int, proposer: Proposer | None) -> None:
        t0 = time.perf_counter()
        view = self.cache.rows(row, row + 1)
        dev = self.target.device
        ids = torch.tensor([seq.token_ids], device=dev)
        pos = torch.arange(len(seq.token_ids), device=dev).unsqueeze(0)
        hidden = self.target(ids, pos, view)  # [1, P, D]
        logits = self.target.compute_logits(hidden[0, -1:])
        self.cache.set_length(row, seq.prompt_len)
        start_sequence(seq, logits, proposer, t0)
        share_hidden(proposer, self.target, hidden, (0,))

    def _release(self, row: int) -> None:
        last = len(self.running) - 1
        if row != last:
            self.cache.move_row(last, row)
            self.running[row] = self.running[last]
        self.cache.lengths[last] = 0
        self.running.pop()

    # ---- one step ---------------------------------------------------------------------------------

    def _choose_ks(self) -> list[int]:
        """Each sequence's own best k, then one batch-wide cap that maximises tokens per second."""
        wants = []
        for r in self.running:
            seq = r.seq
            left = seq.params.max_tokens - seq.num_output
            allowed = cap_draft_len(self.k_max, len(seq.token_ids), self.max_len, left)
            wants.append(r.policy.next_k(allowed) if r.policy is not None else 0)
        if self.cost is None or not any(wants):
            return wants
        # A k the user fixed (server-wide or per request) is honoured; only adaptive rows are capped.
        adaptive = [r.policy is not None and r.policy.fixed_k is None for r in self.running]
        # A dip below the recent batch size (requests finishing just before the next ones arrive) is
        # transient: a row that would have to catch up first pays it all now, not over 16 steps.
        dip = max(self._recent_rows, default=0) > len(self.running)
        catch_up = [self._catch_up_share(r, dip) for r in self.running]
        n = len(wants)
        best_cap, best_rate = 0, -1.0
        for cap in range(max(wants) + 1):
            ks = [min(w, cap) if a else w for w, a in zip(wants, adaptive, strict=True)]
            tokens = sum(r.policy.tracker.expected_tokens(k) if r.policy else 1.0 for r, k in zip(self.running, ks,
                                                                                                   strict=True))
            seconds = self.cost.forward_seconds(n * (cap + 1)) + sum(ks) * self.cost.draft_step_seconds
            seconds += sum(c for c, k in zip(catch_up, ks, strict=True) if k > 0)
            rate = tokens / seconds
            if rate > best_rate * (1 + 1e-9):
                best_cap, best_rate = cap, rate
        return [min(w, best_cap) if a else w for w, a in zip(wants, adaptive, strict=True)]

    def _catch_up_share(self, r: Running, dip: bool = False) -> float:
        """A row's draft catch-up (feeding what its proposer has not seen since it last drafted) spread
        over the steps it is likely to serve: one long catch-up is paid once, not every step, but a row
        that pauses and resumes drafting pays it again. Without this, rows admitted with the prior
        acceptance, or probing under load, paid a whole-context draft prefill for a step or two."""
        tokens = getattr(r.proposer, "catch_up_tokens", None)
        if tokens is None or self.cost is None:
            return 0.0
        left = r.seq.params.max_tokens - r.seq.num_output
        horizon = 1 if dip else max(1, min(CATCH_UP_HORIZON_STEPS, left // 2))
        return tokens(r.seq.view()) * self.cost.catch_up_token_seconds / horizon

    def step(self) -> list[Sequence]:
        """Admit waiting requests, run one verify pass over all running ones; returns sequences with news."""
        t_start = time.perf_counter()
        touched = self._admit()
        if not self.running:
            return touched
        self._recent_rows.append(len(self.running) + len(self.waiting))
        ks = self._choose_ks()
        t0 = time.perf_counter()
        drafts = [
            r.proposer.propose(r.seq.view(), k) if (r.proposer is not None and k > 0) else Draft()
            for r, k in zip(self.running, ks, strict=True)
        ]
        t1 = time.perf_counter()
        n, width = len(self.running), max(len(d) for d in drafts) + 1
        dev = self.target.device
        tokens = torch.zeros(n, width, dtype=torch.long)
        positions = torch.zeros(n, width, dtype=torch.long)
        for i, (r, d) in enumerate(zip(self.running, drafts, strict=True)):
            start = len(r.seq.token_ids) - 1
            row = [r.seq.token_ids[-1], *d.tokens]
            tokens[i, : len(row)] = torch.tensor(row)
            tokens[i, len(row) :] = row[-1]  # padding: harmless tokens past the real ones, masked by slot
            positions[i] = torch.arange(start, start + width)
        hidden = self.target(tokens.to(dev), positions.to(dev), self.cache.rows(0, n))
        logits = self.target.compute_logits(hidden)  # [n, width, V]
        finished_rows = []
        for i, (r, d) in enumerate(zip(self.running, drafts, strict=True)):
            seq = r.seq
            out, accepted = verify_draft(seq, logits[i, : len(d) + 1], d)
            self.cache.set_length(i, len(seq.token_ids) + accepted)
            share_hidden(r.proposer, self.target, hidden, (i, slice(0, accepted + 1)))
            emitted = 0
            for tok in out:
                seq.append(tok)
                emitted += 1
                if seq.finished:
                    break
            share = 1.0 / n  # the forward served every row; attribute an equal share of its time
            seq.stats.observe(len(d), accepted, emitted, (t1 - t0) * share, (time.perf_counter() - t1) * share)
            if r.policy is not None:
                r.policy.observe(len(d), accepted)
            if not seq.finished and len(seq.token_ids) >= self.max_len:
                seq.finish_length()
            if seq.finished:
                finished_rows.append(i)
            elif r.proposer is not None:
                r.proposer.on_verified(seq.view(), accepted)
            touched.append(seq)
        for i in reversed(finished_rows):
            self._release(i)
        self.last_step_seconds = time.perf_counter() - t_start
        if STEP_LOG is not None:  # diagnosing load-aware drafting: one JSON line per step
            with open(STEP_LOG, "a") as f:
                f.write(json.dumps({"rows": n, "ks": ks, "drafted": [len(d) for d in drafts],
                                    "admitted": len(touched) - n, "draft_s": round(t1 - t0, 4),
                                    "step_s": round(self.last_step_seconds, 4)}) + "\n")
        return touched

    # ---- start-up measurement ----------------------------------------------------------------------

    def measure_cost(self, context: int = 64, repeats: int = 2) -> BatchCost:
        """Time target forwards over 1..max_num_seqs*(k_max+1) tokens (rows x width), once at start-up."""
        dev = self.target.device
        widths = sorted({1, 2, 4, self.k_max + 1})
        rows = sorted({1, 2, 4, 8, 16, self.max_num_seqs} & set(range(1, self.max_num_seqs + 1)))
        context = min(context, self.max_len - self.k_max - 2)
        view = self.cache.rows(0, self.max_num_seqs)
        self.target(torch.ones(self.max_num_seqs, context, dtype=torch.long, device=dev),
                    torch.arange(context, device=dev).expand(self.max_num_seqs, context), view)
        points: dict[int, float] = {}
        for b in rows:
            for w in widths:
                ids = torch.ones(b, w, dtype=torch.long, device=dev)
                pos = torch.arange(context, context + w, device=dev).expand(b, w)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    self.target.compute_logits(self.target(ids, pos, self.cache.rows(0, b)))
                    best = min(best, time.perf_counter() - t0)
                points[b * w] = min(points.get(b * w, best), best)
        self.cache.reset()
        probe = self.proposer_factory() if self.proposer_factory is not None else None
        draft = probe.step_cost_hint() if probe is not None else 0.0
        # Measured once on a probe proposer; every row's estimate uses it (rows never measure).
        catch_up = float(getattr(probe, "catch_up_token_seconds", 0.0))
        self.cost = BatchCost(tuple(sorted(points.items())), draft, catch_up)
        return self.cost
