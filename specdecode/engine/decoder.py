"""The speculative step loop for one sequence: propose, verify in one target forward, truncate, adapt."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from specdecode.engine.adaptive import AdaptiveK, CostModel, tree_node_budget
from specdecode.engine.sequence import Sequence
from specdecode.engine.step_verify import share_hidden, start_sequence, verify_draft, verify_tree_draft
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Draft, Proposer
from specdecode.proposers.ngram_match import cap_draft_len
from specdecode.proposers.tree_growth import priced_nodes, with_lookup_branch
from specdecode.proposers.tree_value import TreeValue
from specdecode.tree import MAX_TREE_NODES, build_tree


@dataclass
class StepResult:
    tokens: list[int]
    num_drafted: int
    num_accepted: int
    depth: int
    """Positions offered: k for a chain, the longest path for a tree."""
    draft_seconds: float
    verify_seconds: float
    drafter_accepted: int = 0
    """Accepted tree nodes that the drafter proposed itself (not a grafted lookup guess)."""


class SpeculativeDecoder:
    """Owns the target's KV cache; the only place that changes its length."""

    def __init__(
        self,
        target: Transformer,
        max_len: int,
        proposer: Proposer | None = None,
        k_max: int = 0,
        fixed_k: int | None = None,
        tree_lookup: tuple[int, int] | None = None,
    ) -> None:
        self.target = target
        self.cache = target.new_cache(1, max_len + MAX_TREE_NODES)  # headroom: a tree step's scratch slots
        self.max_len = max_len
        self.proposer = proposer
        self.k_max = k_max if proposer is not None else 0
        self.fixed_k = fixed_k
        self.tree_lookup = tree_lookup
        """(min_n, max_n): every tree draft gets the prompt-lookup guess as one more branch, verified in the
        same target forward (copied text is accepted through the guess, the rest through the drafter)."""
        self.cost: CostModel | None = None

    # ---- one target forward over [pending token] + draft ------------------------------------

    def _forward(self, tokens: list[int], start: int, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target over tokens at positions start..: hidden [1, T, D] and fp32 logits [T, V]
        ([1, V] if last_only)."""
        dev = self.target.device
        ids = torch.tensor([tokens], device=dev)
        pos = torch.arange(start, start + len(tokens), device=dev).unsqueeze(0)
        hidden = self.target(ids, pos, self.cache)
        # A prompt needs only its last position's logits: the output matrix is the largest one.
        return hidden, self.target.compute_logits(hidden[0, -1:] if last_only else hidden[0])

    def prefill(self, seq: Sequence) -> None:
        """Process the prompt, emit the first token, start the proposer."""
        t0 = time.perf_counter()  # timing starts here, not when generate() validated the whole batch
        self.cache.reset()
        hidden, logits = self._forward(seq.token_ids, 0, last_only=True)  # [1, P, D], [1, V]
        self.cache.set_length(0, seq.prompt_len)
        start_sequence(seq, logits, self.proposer, t0)
        share_hidden(self.proposer, self.target, hidden, (0,))

    def step(self, seq: Sequence, k: int) -> StepResult:
        """Propose k tokens, verify them in one target forward, roll the cache back to what was kept."""
        t0 = time.perf_counter()
        draft = self.proposer.propose(seq.view(), k) if (self.proposer is not None and k > 0) else Draft()
        t1 = time.perf_counter()
        n = len(seq.token_ids)  # the cache holds n-1 tokens; the last one is pending
        depth = len(draft)
        own = 0
        if draft.is_tree:
            drafted = len(draft)  # the drafter's own nodes; a grafted branch comes after them
            draft = with_lookup_branch(draft, seq.token_ids, self.tree_lookup, k)
            out, nodes, depth = self._verify_tree_step(seq, draft, n)
            accepted = len(nodes)
            own = sum(1 for i in nodes if i <= drafted)
        else:
            hidden, logits = self._forward([seq.token_ids[-1], *draft.tokens], n - 1)  # [1, k+1, D], [k+1, V]
            out, accepted = verify_draft(seq, logits, draft)
            share_hidden(self.proposer, self.target, hidden, (0, slice(0, accepted + 1)))
        # Kept: the pending token and the accepted drafts; the new token becomes pending.
        self.cache.set_length(0, n + accepted)
        return StepResult(out, len(draft), accepted, depth, t1 - t0, time.perf_counter() - t1, own)

    def _verify_tree_step(self, seq: Sequence, draft: Draft, n: int) -> tuple[list[int], list[int], int]:
        """One target forward over the whole tree with tree attention; the accepted path's K/V is then
        compacted to follow the prefix. Returns the output tokens, the accepted path's node indices and
        the tree's depth."""
        assert draft.parents is not None
        buffers = build_tree([-1, *draft.parents])
        tokens = torch.tensor([seq.token_ids[-1], *draft.tokens])  # [N]; node 0 = pending token
        size = tokens.shape[0]
        dev = self.target.device
        slots = torch.arange(n - 1, n - 1 + size)  # one slot per node, after the prefix
        mask = torch.zeros(size, n - 1 + size, dtype=torch.bool)
        mask[:, : n - 1] = True  # every node sees the whole prefix ...
        mask[:, n - 1 :] = buffers.attn_mask  # ... and its ancestors
        hidden = self.target(tokens[None].to(dev), buffers.positions(n)[None].to(dev), self.cache,
                             slots=slots[None].to(dev), attn_mask=mask[None].to(dev))
        logits = self.target.compute_logits(hidden[0])  # [N, V]
        out, nodes = verify_tree_draft(seq, logits, tokens, buffers)
        self.cache.compact(0, [n - 1 + i for i in nodes], n)
        # the root (pending token) and the accepted path
        share_hidden(self.proposer, self.target, hidden, (0, [0, *nodes]))
        return out, nodes, buffers.max_depth

    # ---- the loop -------------------------------------------------------------------------------

    def new_policy(self) -> AdaptiveK | None:
        if self.proposer is None:
            return None
        if self.fixed_k is not None:
            return AdaptiveK(fixed_k=self.fixed_k)
        return AdaptiveK(self.cost)

    def generate(self, seq: Sequence, on_step: Callable[[Sequence], None] | None = None) -> Sequence:
        """Run seq to completion: propose -> verify -> truncate -> observe -> adapt."""
        for _ in self.iterate(seq):
            if on_step is not None:
                on_step(seq)
        return seq

    def iterate(self, seq: Sequence) -> Iterator[Sequence]:
        """Yield after prefill and after each step (for streaming)."""
        if len(seq.token_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(seq.token_ids)} tokens does not fit the context of {self.max_len}")
        self.prefill(seq)
        yield seq
        policy = self.new_policy()
        tree_value: TreeValue | None = getattr(self.proposer, "tree_value", None)  # per-request, like the policy
        if tree_value is not None:
            tree_value.reset()
        while not seq.finished:
            if len(seq.token_ids) >= self.max_len:
                seq.finish_length()
                break
            k_allowed = cap_draft_len(
                self.k_max, len(seq.token_ids), self.max_len, seq.params.max_tokens - seq.num_output
            )
            k = policy.next_k(k_allowed) if policy is not None else 0
            res = self.step(seq, k)
            emitted = 0
            for tok in res.tokens:
                seq.append(tok)
                emitted += 1
                if seq.finished:
                    break
            seq.stats.observe(res.num_drafted, res.num_accepted, emitted, res.draft_seconds, res.verify_seconds,
                              draft_depth=res.depth)
            if policy is not None:
                policy.observe(res.depth, res.num_accepted)
            if tree_value is not None:
                tree_value.observe(res.drafter_accepted)
            if self.proposer is not None and not seq.finished:
                self.proposer.on_verified(seq.view(), res.num_accepted)
            yield seq

    # ---- cost model for adaptive k ---------------------------------------------------------------

    def measure_cost(self, context: int = 128, repeats: int = 3, flat: bool = False) -> CostModel:
        """Time target forwards over t = 1..k_max+1 tokens (up to a full tree for tree proposers) and one
        draft step, at start-up; a dynamic-width tree proposer gets its node budget from the result.

        `flat` keeps only the 1-token time and prices every larger forward the same, as on a GPU whose
        forward of a 1.5B model stays memory-bound up to the largest tree: the benchmark uses it to show
        the trees (and τ) such hardware would choose, on a CPU where they are too slow to pay."""
        tree = getattr(self.proposer, "tree_width", 1) != 1
        top = MAX_TREE_NODES + 1 if tree else self.k_max + 1
        wanted = {1, 2, 3, 4, 6, 8, self.k_max + 1} | ({12, 16, 24, 32, 48, top} if tree else set())
        ts = sorted(t for t in wanted if t <= top)
        # A short max_len leaves less room: shrink the context, then drop the t that do not fit after it.
        context = max(0, min(context, self.max_len - top - 1))
        ts = [t for t in ts if context + t <= self.max_len] or [1]
        if context:
            self._forward([1] * context, 0, last_only=True)  # warm-up and a realistic cache
        timed = ts[:1] if flat else ts  # a flat curve needs only the 1-token time
        samples: dict[int, list[float]] = {t: [] for t in timed}
        for _ in range(repeats):  # rounds over every t: a slow spell of a shared machine slows all t alike,
            for t in timed:  # so the ratios that choose k and the tree stay right (measured t=1 swung 66-103 ms)
                t0 = time.perf_counter()
                self._forward([1] * t, context)
                samples[t].append(time.perf_counter() - t0)
        points = {t: statistics.median(s) for t, s in samples.items()}
        if flat:
            points = dict.fromkeys(ts, points[ts[0]])
        self.cache.reset()
        draft_step = self.proposer.step_cost_hint() if self.proposer is not None else 0.0
        cost = CostModel.from_points(points, max(ts), draft_step_seconds=draft_step)
        nodes: tuple[int, ...] = ()
        if tree:
            proposer = self.proposer
            proposer.node_budget = min(MAX_TREE_NODES, tree_node_budget(cost, self.k_max))  # type: ignore[union-attr]
            width = proposer.tree_width  # type: ignore[union-attr]
            nodes = tuple(min(MAX_TREE_NODES, priced_nodes(width, proposer.node_budget, k))  # type: ignore
                          for k in range(1, self.k_max + 1))
        self.cost = CostModel.from_points(points, max(ts), draft_step_seconds=draft_step, tree_nodes=nodes)
        if tree:
            self.proposer.tree_value = TreeValue(self.cost.target_forward_seconds)  # type: ignore[union-attr]
        elif hasattr(self.proposer, "target_seconds"):  # a draft model weighing lookup guesses against drafting
            self.proposer.target_seconds = self.cost.target_forward_seconds  # type: ignore[union-attr]
        return self.cost
