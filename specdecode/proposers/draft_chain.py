"""One row's chain drafted by a draft model, as a state machine the caller feeds forwards to.

The caller (`DraftModelRows`) runs the draft model over every drafting row in one forward per depth;
`ChainDraft` picks each row's tokens and says what to feed it next.

With a lookup source, each forward also carries a guess of what the draft will pick next: what most often
followed the suffix before (proposers/suffix_source.py). One forward over [token, guess...] gives the
draft's logits after every guessed token; the guess holds as long as the draft picks its tokens, so an
accepted run of g guesses costs one forward instead of g. The tokens (and, sampling, the uniforms drawn and
the probabilities) are those of the plain loop, up to the float rounding of a wider forward: a wrong guess
only wastes rows of a forward. Penalties keep the plain loop (their counts change with every drafted token).

Under a grammar the draft picks from the tokens the grammar allows (any q is lossless; one that follows the
grammar is accepted far more often): the request's matcher advances along the chain while drafting and is
rolled back by `draft()` (or `rollback()` when drafting stops early), so it stands where it stood before.
"""

from __future__ import annotations

import torch

from specdecode.proposers.base import Draft, SequenceView
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.sampling import draw_uniforms, logits_to_probs, sample_from_probs


class ChainDraft:
    def __init__(self, seq: SequenceView, k: int, lookup: SuffixSource | None) -> None:
        self.seq, self.k = seq, k
        self.lookup = lookup if seq.output_counts is None else None
        self.stochastic = not seq.params.greedy
        self.tokens: list[int] = []
        self.probs_rows: list[torch.Tensor] = []
        self.guess: list[int] = []
        self.matcher = seq.matcher
        self.consumed = 0
        """Tokens the matcher advanced over while drafting (rolled back when the chain is handed over)."""

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.k

    def pick(self, row: torch.Tensor) -> int:
        """The draft's next token from its logits row [V] (one uniform drawn when sampling)."""
        params, seq = self.seq.params, self.seq
        if self.matcher is not None:
            allowed = self.matcher.allowed().to(row.device)  # [V]
            row = row[: allowed.shape[0]].masked_fill(~allowed[: row.shape[0]], float("-inf"))
        if params.raw_argmax:
            tok = int(row.argmax())
        else:
            row_counts = None
            if seq.output_counts is not None:
                # Position i sees the draft tokens before it as output, as the target will.
                drafted = torch.tensor(self.tokens, dtype=torch.long, device=seq.output_counts.device)
                row_counts = seq.output_counts + torch.bincount(drafted, minlength=seq.output_counts.shape[-1])
            probs = logits_to_probs(row, params, row_counts, seq.prompt_mask)  # [V]
            if not self.stochastic:
                tok = int(probs.argmax())
            else:
                self.probs_rows.append(probs)
                tok = int(sample_from_probs(probs, draw_uniforms(1, seq.generator)[0]))
        self.tokens.append(tok)
        if self.matcher is not None and self.matcher.consume(tok):
            self.consumed += 1
        return tok

    def next_feed(self) -> list[int]:
        """What the next forward feeds: the newest drafted token and a guess of the draft's next ones."""
        left = self.k - len(self.tokens)
        seq = self.seq
        self.guess = (self.lookup.chain(seq.token_ids + self.tokens, seq.tenant, left, seq.params.greedy)
                      if self.lookup else [])
        return [self.tokens[-1], *self.guess]

    def take(self, rows: torch.Tensor) -> int:
        """The forward's logits [1 + len(guess), V] after each fed token; picks tokens while the guess holds.
        Returns how many fed tokens agree with the draft (the cache keeps only those)."""
        guess = self.guess
        used = 0
        while True:
            self.pick(rows[used])
            if used == len(guess) or self.tokens[-1] != guess[used] or self.done:
                break
            used += 1
        return used + 1

    def rollback(self) -> None:
        """Put the grammar's matcher back where it stood before this chain (idempotent)."""
        if self.matcher is not None and self.consumed:
            self.matcher.rollback(self.consumed)
        self.consumed = 0

    def draft(self) -> Draft:
        self.rollback()
        return Draft(self.tokens, torch.stack(self.probs_rows) if self.stochastic else None)
