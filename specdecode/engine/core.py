"""The engine core: continuous batching with speculation; every caller's requests are rows of one batch.

`LLM.generate` (all prompts at once), `LLM.stream`, the server and `specdecode bench` all run requests
here, and a single request is a batch of one. A step is a sequence of named phases:

    schedule -> propose -> constrain -> plan -> target forward -> verify -> commit -> observe/adapt

Running sequences occupy cache rows 0..n-1 (a finished one's row is refilled by moving the last row into
it), so a step runs the target over a contiguous view of the cache. Every row's draft is a tree (a chain
is a tree with one branch), verified in one target forward over all rows with per-row tree attention;
the accepted path's K/V is then compacted behind the row's prefix.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from specdecode.cost_model import CostModel
from specdecode.engine.adaptive import AdaptiveK
from specdecode.engine.chunking import ChunkTimer
from specdecode.engine.constrain import constrain_rows
from specdecode.engine.history import RequestHistory
from specdecode.engine.lookup_guess import RowGuess, guess_alone, lookup_drafts, with_lookup_branch
from specdecode.engine.plan import RowTree, StepPlan, build_plan
from specdecode.engine.prefill_share import PrefillShares
from specdecode.engine.prefix_cache import PrefixCache
from specdecode.engine.row_faults import guarded, propose_rows
from specdecode.engine.running import Running
from specdecode.engine.schedule import Lengths, PreferredDraft, choose_lengths, node_budget, row_catch_up, row_cost
from specdecode.engine.sequence import Sequence
from specdecode.engine.step_log import log_step
from specdecode.engine.step_verify import Verified, append_verified, start_sequence, verify_rows
from specdecode.model.kv_cache import KVCache
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import BatchProposer, Draft, ProposeRow
from specdecode.proposers.ngram_match import cap_draft_len
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.tree import MAX_TREE_NODES


class QueueFullError(RuntimeError):
    """More requests are waiting than the engine accepts; retry later."""


class Engine:
    """Owns the target's KV cache: the only place that changes its lengths."""

    def __init__(self, target: Transformer, max_len: int, proposer: BatchProposer | None = None, k_max: int = 0,
                 fixed_k: int | None = None, cost: CostModel | None = None, max_num_seqs: int = 8,
                 max_waiting: int | None = 64, lookup: SuffixSource | None = None,
                 allocate: bool = True, prefix_cache: PrefixCache | None = None,
                 max_num_batched_tokens: int | None = None, history: RequestHistory | None = None) -> None:
        self.target = target
        self.history = history or RequestHistory()
        """Earlier requests of this pair: a new row's acceptance prior, a request's expected length (history.py)."""
        self.max_len = max_len
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        """None: no bound (`LLM.generate` queues all its prompts)."""
        self.k_max = k_max if proposer is not None else 0
        self.fixed_k = fixed_k
        self.lookup = lookup
        """Where lookup guesses come from (None: off): a row proposes its guess alone where that pays more than its
        drafter, else tree drafts get it as one more branch (engine/lookup_guess.py). Answers go to its store."""
        self.proposer: BatchProposer | None = None
        self._cost: CostModel | None = None
        self.row_cost: CostModel | None = None
        self.cache: KVCache | None = None
        self.set_proposer(proposer, cost)
        if allocate:
            self.reserve(max_num_seqs)
        self.prefix_cache = prefix_cache
        """K/V of finished prefixes (None: prefix caching off)."""
        self.max_num_batched_tokens = max_num_batched_tokens
        """At most this many prompt tokens prefilled per step while other rows decode (None: a whole prompt at
        once); the chunk is the largest that costs about `CHUNK_STEP_RATIO` decode steps (engine/chunking.py)."""
        self._chunks = ChunkTimer()
        self.running: list[Running] = []
        self.prefilling: Running | None = None
        """The request whose prompt is being prefilled in chunks, in the row after the running ones."""
        self._shares = PrefillShares()
        self.waiting: deque[tuple[Sequence, int | None]] = deque()
        self.last_step_seconds = 0.0
        self._keys = itertools.count()
        self._recent_rows: deque[int] = deque(maxlen=8)
        """Rows running or waiting at each of the last steps (tells a dip from a lower load)."""

    # ---- configuration -----------------------------------------------------------------------------

    def set_proposer(self, proposer: BatchProposer | None, cost: CostModel | None = None) -> None:
        """Draft with `proposer` from now on (configured with the cost model, if any)."""
        self.proposer = proposer
        self.cost = cost if cost is not None else self._cost
        if proposer is not None and self.cache is not None:
            proposer.reserve(self.cache.batch_size)

    @property
    def cost(self) -> CostModel | None:
        return self._cost

    @cost.setter
    def cost(self, cost: CostModel | None) -> None:
        """The measured cost model; None keeps every row's k as the policy chose it (no batch cap)."""
        self._cost, self.row_cost = cost, cost
        if cost is not None and self.proposer is not None:
            self.row_cost = row_cost(cost, self.proposer.capabilities.tree_width, self.k_max)
            self.proposer.configure(cost)

    def reserve(self, rows: int) -> None:
        """Make room for `rows` running rows (allocated up front for serving, on demand for `generate`)."""
        rows = min(max(1, rows), self.max_num_seqs)
        if self.proposer is not None:
            self.proposer.reserve(rows)
        if self.cache is not None and self.cache.batch_size >= rows:
            return
        # Headroom past max_len: a step's tree (or padded chain) occupies slots after the row's prefix.
        cache = self.target.new_cache(rows, self.max_len + MAX_TREE_NODES)
        if self.cache is not None:
            cache.take_rows(self.cache)
        self.cache = cache

    # ---- admission ----------------------------------------------------------------------------------

    def add(self, seq: Sequence, k_override: int | None = None) -> None:
        """Queue a request; raises QueueFullError beyond max_waiting, ValueError if it can never fit."""
        need = seq.prompt_len + seq.params.max_tokens
        if need > self.max_len:
            raise ValueError(
                f"prompt ({seq.prompt_len} tokens) + max_tokens ({seq.params.max_tokens}) exceeds the context "
                f"length {self.max_len}"
            )
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting")
        self.waiting.append((seq, k_override))

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone); its row and KV are free for the next step."""
        for i, (seq, _) in enumerate(self.waiting):
            if seq.request_id == request_id:
                del self.waiting[i]
                seq._finish("abort")
                return True
        r = self.prefilling
        if r is not None and r.seq.request_id == request_id:
            r.seq._finish("abort")
            if r.policy is not None and self.proposer is not None:
                self.proposer.release(r.key)
            assert self.cache is not None
            self.cache.lengths[len(self.running)] = 0
            self.prefilling = None
            return True
        for i, r in enumerate(self.running):
            if r.seq.request_id == request_id:
                r.seq._finish("abort")
                self._release(i)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.prefilling)

    @property
    def kv_usage(self) -> float:
        """Fraction of cache slots holding live tokens."""
        used = sum(len(r.seq.token_ids) for r in self.running)
        used += self.prefilling.prefilled if self.prefilling is not None else 0
        return used / (self.max_num_seqs * self.max_len)

    def _admit(self) -> list[Sequence]:
        """Prefill newcomers one at a time, in arrival order, into the row after the running ones. While rows
        decode, at most max_num_batched_tokens prompt tokens per step (a long prompt takes several steps, and
        the running rows get a token each step); otherwise whole prompts. Returns the sequences that joined."""
        budget = None
        if self.running and self.max_num_batched_tokens is not None:
            budget = self._chunks.budget(self.max_num_batched_tokens)
        admitted = []
        while budget is None or budget > 0:
            r = self.prefilling
            if r is None:
                if not self.waiting or len(self.running) >= self.max_num_seqs:
                    break
                r = self.prefilling = self._start_prefill()
            left = r.seq.prompt_len - r.prefilled
            chunk = left if budget is None else min(left, budget)
            t0 = time.perf_counter()
            if chunk:  # none left: a sibling choice copied the whole prompt
                self._prefill(r, len(self.running), chunk)
            if budget is not None:
                budget -= chunk
                self._chunks.chunk_ran(chunk, time.perf_counter() - t0)
            if r.prefilled < r.seq.prompt_len:
                break
            self.prefilling = None
            self.running.append(r)
            self._remember(len(self.running) - 1)  # a prompt shared by requests right behind it
            admitted.append(r.seq)
            if r.seq.finished:
                self._release(len(self.running) - 1)
        return admitted

    def _policy(self, k_override: int | None) -> AdaptiveK:
        fixed = k_override if k_override is not None else self.fixed_k
        if fixed is not None:
            return AdaptiveK(fixed_k=fixed)
        assert self.row_cost is not None, "an adaptive draft length needs the measured cost (measure_cost)"
        return AdaptiveK(self.row_cost, prior=self.history.prior())

    def _start_prefill(self) -> Running:
        """Take the next waiting request into the free row; copy in its sibling's whole prompt, or else its
        longest pooled prefix."""
        seq, k_override = self.waiting.popleft()
        self.reserve(len(self.running) + 1)
        assert self.cache is not None
        drafts = self.proposer is not None and k_override != 0
        r = Running(seq, next(self._keys), self._policy(k_override) if drafts else None)
        hidden, next_waiting = self._reads_features(r), self.waiting[0][0] if self.waiting else None
        shared = self._shares.copy_into(r, len(self.running), self.running, next_waiting, self.cache, hidden)
        if shared is not None:
            features = shared.source.features
            self._begin(r, features[: seq.prompt_len] if hidden and features is not None else None)
            start_sequence(seq, shared.logits, r.started)
            return r
        features = None
        if self.prefix_cache is not None:  # the prompt's last token is always computed: its logits give the first
            r.prefilled, features = self.prefix_cache.restore(self.cache, len(self.running), seq.token_ids,
                                                              seq.prompt_len - 1, hidden, seq.cache_salt)
        seq.cached_tokens = r.prefilled
        self.cache.set_length(len(self.running), r.prefilled)
        self._begin(r, features)
        return r

    def _begin(self, r: Running, features: torch.Tensor | None) -> None:
        """Start the row's drafting state, with the target's features [P, F] of the positions already kept."""
        if r.policy is None or self.proposer is None:
            return
        self.proposer.begin(r.key, r.seq.view())
        if features is not None:
            self._feed(r, features, 0)

    def _reads_features(self, r: Running) -> bool:
        return r.policy is not None and self.proposer is not None and self.proposer.capabilities.target_hidden

    def _prefill(self, r: Running, row: int, n: int) -> None:
        """Prefill the next n prompt tokens of r in `row`; the last chunk emits the first output token."""
        seq = r.seq
        assert self.cache is not None
        if not r.started:  # the request's own timing starts with its first forward
            r.started = time.perf_counter()
        dev = self.target.device
        start = r.prefilled
        ids = torch.tensor([seq.token_ids[start : start + n]], device=dev)
        pos = torch.arange(start, start + n, device=dev).unsqueeze(0)
        hidden = self.target(ids, pos, self.cache.rows(row, row + 1))  # [1, n, D]
        r.prefilled = start + n
        self.cache.set_length(row, r.prefilled)
        self._share_hidden(r, hidden, 0, slice(None), start)
        if r.prefilled == seq.prompt_len:
            logits = self.target.compute_logits(hidden[0, -1:])  # the output matrix is the largest: last row only
            self._shares.offer(r, logits)  # its sibling choices behind it copy this prefill
            start_sequence(seq, logits, r.started)

    def _release(self, row: int) -> None:
        assert self.cache is not None
        self._remember(row)
        self._shares.forget(self.running[row])
        self.history.finished(self.running[row].policy, self.running[row].seq)
        if self.running[row].policy is not None and self.proposer is not None:
            self.proposer.release(self.running[row].key)
        last = len(self.running) - 1
        if row != last:
            self.cache.move_row(last, row)
            self.running[row] = self.running[last]
        self.cache.lengths[last] = 0
        self.running.pop()
        if self.prefilling is not None:  # it stays in the row right after the running ones
            self.cache.move_row(last + 1, last)

    def _remember(self, row: int) -> None:
        """Pool the committed blocks of a running row (its K/V, and features where its proposer reads them), and
        keep its answer for later lookups."""
        r = self.running[row]
        if self.lookup is not None and r.seq.finish_reason not in (None, "abort", "error"):
            self.lookup.remember(r.seq.cache_salt, r.seq.token_ids, r.seq.prompt_len)
        if self.prefix_cache is not None and self.cache is not None and (
                r.features is not None or not self._reads_features(r)):
            self.prefix_cache.remember(self.cache, row, r.seq.token_ids, r.features, r.seq.cache_salt)

    def _share_hidden(self, r: Running, hidden: torch.Tensor, row: int, index: slice | list[int], at: int) -> None:
        """Head proposers read the target's features of the positions just kept (from position `at` on): from the
        forward's final-norm output hidden [B, T, D], or from the layers it captured for a fused-feature head."""
        if self._reads_features(r):
            source = hidden if self.target.captured is None else self.target.captured
            self._feed(r, source[row, index], at)

    def _feed(self, r: Running, features: torch.Tensor, at: int) -> None:
        """The target's features [m, F] of positions at.. go to the row's proposer, and are kept for pooling
        (prefix cache on) and for the sibling choices that copy the row's prompt."""
        assert self.proposer is not None
        if self.prefix_cache is not None or r.seq.prefill_group is not None:
            r.keep_features(features, at, self.max_len + MAX_TREE_NODES)
        self.proposer.observe_hidden(r.key, features)

    # ---- one step -------------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Admit waiting requests, run one speculative step over all running ones; returns sequences with news."""
        t_start = time.perf_counter()
        touched = self._admit()  # schedule: admission (and the newcomers' prefill)
        fresh = {id(s) for s in touched}
        if all(id(r.seq) in fresh for r in self.running):
            # Only newcomers run: their first tokens go out now, before their drafters catch up on the prompt.
            return touched
        t_decode = time.perf_counter()
        lengths = self._schedule()
        t0 = time.perf_counter()
        rows = self._propose(lengths)
        masks = self._constrain(rows)
        t1 = time.perf_counter()
        plan = build_plan(rows, [len(r.seq.token_ids) - 1 for r in self.running])
        hidden, logits = self._target_forward(plan)
        verdicts = verify_rows([r.seq for r in self.running], rows, plan, logits, masks)
        seconds = (t1 - t0, time.perf_counter() - t1)
        touched += [r.seq for r in self.running]
        for i in reversed(self._commit(plan, rows, verdicts, hidden, seconds)):  # and observe/adapt
            self._release(i)
        end = time.perf_counter()
        self.last_step_seconds = end - t_start
        self._chunks.decode_ran(end - t_decode)
        log_step(lengths.ks, [r.num_drafted for r in rows], lengths.node_budget, t1 - t0, t_decode - t_start,
                 self.last_step_seconds)
        return touched

    def _schedule(self) -> Lengths:
        """Each row's draft length and the per-row tree budget, from the cost of the whole batch forward."""
        self._recent_rows.append(len(self.running) + len(self.waiting))
        dip = max(self._recent_rows, default=0) > len(self.running)  # a transient dip below the recent load
        budget = node_budget(self._cost, self.k_max, len(self.running))
        preferred, guesses = [], []
        lookup = self.proposer is not None and self.proposer.capabilities.lookup
        allowed_ks = [self._allowed(r) for r in self.running]
        ks = [r.policy.next_k(a) if r.policy is not None else 0 for r, a in zip(self.running, allowed_ks, strict=True)]
        if lookup:  # a lookup drafts for free: the batch prices the nodes it found, not the k allowed
            ks = lookup_drafts(self.proposer, self.running, ks, self.target.config.vocab_size)
        for r, k, allowed in zip(self.running, ks, allowed_ks, strict=True):
            catch_up = row_catch_up(self.proposer, self._cost, r, k, dip, self.history.expected_length(r.seq.params))
            guess = RowGuess(r.seq.token_ids, None if lookup else self.lookup, r.seq.cache_salt, r.seq.params.greedy)
            guess.alone = guess_alone(r, guess, k, allowed, budget, catch_up, self.row_cost)
            guesses.append(guess)
            preferred.append(PreferredDraft(len(guess.alone), r.policy, guess_rate=r.guess_rate.alpha(0))
                             if guess.alone else PreferredDraft(k, r.policy, catch_up))
        width = self.proposer.capabilities.tree_width if self.proposer is not None else 1
        lengths = choose_lengths(preferred, self._cost, width, self.k_max)
        for guess, k in zip(guesses, lengths.ks, strict=True):
            guess.alone = guess.alone[:k]  # the batch-wide cap may cut it
        lengths.guesses = guesses
        return lengths

    def _allowed(self, r: Running) -> int:
        """The row's cap on k: the engine's k_max, the context left, the tokens the request has left."""
        seq = r.seq
        return cap_draft_len(self.k_max, len(seq.token_ids), self.max_len, seq.params.max_tokens - seq.num_output)

    def _propose(self, lengths: Lengths) -> list[RowTree]:
        """One proposer call for every row its drafter drafts; the rows the schedule chose it for propose their
        lookup guess alone, and the other tree rows get it grafted as one more branch."""
        graft = self.proposer is not None and self.proposer.capabilities.trees
        guesses = lengths.guesses
        asks = [ProposeRow(r.key, r.seq.view(), k, max(k, lengths.node_budget)) for r, k, guess
                in zip(self.running, lengths.ks, guesses, strict=True) if k > 0 and not guess.alone and not r.drafted]
        seqs, vocab = {r.key: r.seq for r in self.running}, self.target.config.vocab_size
        drafts = iter(propose_rows(self.proposer, asks, seqs, vocab) if self.proposer is not None else [])
        rows = []
        for r, k, guess in zip(self.running, lengths.ks, guesses, strict=True):
            r.guessed = len(guess.alone)
            if r.drafted:  # drafted in the schedule; the batch-wide cap may cut it (its first nodes are a tree)
                drafted = r.drafted.first(k) if k > 0 else Draft()
            else:
                drafted = next(drafts) if k > 0 and not guess.alone else Draft(guess.alone)
            draft = with_lookup_branch(drafted, guess, k) if graft else drafted
            rows.append(RowTree.of(r.seq.token_ids[-1], draft, len(drafted)))
        return rows

    def _constrain(self, rows: list[RowTree]) -> list[torch.Tensor | None] | None:
        """Structured outputs: each row's grammar cuts its draft (rows edited in place) and masks its logits."""
        trackers = [r.policy.tracker if r.policy is not None else None for r in self.running]
        forward = self._cost.target_forward_seconds if self._cost is not None else None
        return constrain_rows([r.seq for r in self.running], trackers, rows, self.max_len, forward)

    def _target_forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over every row's nodes: hidden [B, T, D] and fp32 logits [N, V] of the real nodes."""
        assert self.cache is not None
        dev = self.target.device
        mask = None if plan.mask is None else plan.mask.to(dev)
        hidden = self.target(plan.tokens.to(dev), plan.positions.to(dev), self.cache.rows(0, plan.rows),
                             slots=plan.slots.to(dev), attn_mask=mask)
        flat = hidden.reshape(-1, hidden.shape[-1])
        real = flat if flat.shape[0] == plan.logits_index.numel() else flat[plan.logits_index.to(dev)]
        return hidden, self.target.compute_logits(real)

    def _commit(self, plan: StepPlan, rows: list[RowTree], verdicts: list[Verified], hidden: torch.Tensor,
                seconds: tuple[float, float]) -> list[int]:
        """Keep each row's accepted path (KV compacted behind its prefix), append its tokens (stops apply
        inside the block), then observe: metrics, the row's draft-length policy, its proposer."""
        assert self.cache is not None
        finished = []
        share = 1.0 / plan.rows  # the forward served every row; attribute an equal share of its time
        for i, (r, row, v) in enumerate(zip(self.running, rows, verdicts, strict=True)):
            seq, start = r.seq, plan.starts[i]
            if seq.finished:  # it failed earlier in the step (engine/row_faults.py) and keeps nothing
                finished.append(i)
                continue
            if v.nodes != list(range(1, len(v.nodes) + 1)):  # a chain's accepted prefix is already in place
                self.cache.compact(i, [start + n for n in v.nodes], start + 1)
            self.cache.set_length(i, start + 1 + len(v.nodes))  # the pending token and the accepted drafts
            guarded(seq, "the proposer", self._share_hidden, r, hidden, i, [0, *v.nodes], start)
            emitted = append_verified(seq, v)
            seq.stats.observe(row.num_drafted, len(v.nodes), emitted, seconds[0] * share, seconds[1] * share,
                              draft_depth=v.depth)
            if not seq.finished and len(seq.token_ids) >= self.max_len:
                seq.finish_length()
            self._observe(r, row, v)
            if seq.finished:
                finished.append(i)
        return finished

    def _observe(self, r: Running, row: RowTree, v: Verified) -> None:
        """Adapt: the row's policy learns its acceptance, its proposer what was kept."""
        if r.policy is None:
            return
        # A chain's nodes past the proposer's own are grammar-forced: the policy and the proposer learn
        # from the proposer's part only.
        chain = row.is_chain
        depth, accepted = (min(v.depth, row.drafted), min(len(v.nodes), row.drafted)) if chain else (
            v.depth, len(v.nodes))
        if r.guessed:  # the guess alone: its own rate learns, the policy's tree estimate stands
            r.guess_rate.update(depth, accepted)
        else:
            r.policy.observe(depth, accepted)
        if self.proposer is not None and not r.seq.finished:
            own = sum(1 for n in v.nodes if n <= row.drafted)
            guarded(r.seq, "the proposer", self.proposer.on_verified, r.key, r.seq.view(), accepted, own)
