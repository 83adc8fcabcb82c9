"""Forwards that put one row of interest (its own tokens, positions, slots and visibility) beside random other
rows, for the row-invariance tests: the row's logits must have the same bits in every such forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.model.kv_cache import KVCache
from specdecode.model.transformer import Transformer

MAX_LEN = 192
"""Every cache of these tests has this many slots: the rope tables are then one table."""
WIDEST = 96
"""The widest forward of these tests: a row's padding takes up to this many slots after its own."""


@dataclass
class Row:
    """One row of a forward: its real queries' tokens, rope positions, cache slots and, per query, the slots it
    sees (None: every slot up to its own, a chain's causal mask)."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    sees: list[list[int]] | None = None

    @classmethod
    def chain(cls, tokens: list[int], start: int) -> Row:
        n = len(tokens)
        return cls(list(tokens), list(range(start, start + n)), list(range(start, start + n)))

    def visible(self, j: int) -> list[int]:
        return list(range(self.slots[j] + 1)) if self.sees is None else self.sees[j]


def new_cache(model: Transformer, rows: int, gen: torch.Generator) -> KVCache:
    """A cache whose every slot holds random K/V: a query that read a slot it must not see would change."""
    cache = model.new_cache(rows, MAX_LEN)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def forward(model: Transformer, cache: KVCache, rows: list[Row], implicit_mask: bool = False) -> list[torch.Tensor]:
    """One forward of the rows side by side, padded to the widest (a padding query sits in a free slot after its
    row's and sees only itself, as the engine's plan pads); the logits [n_i, V] of each row's real queries, taken
    from one output-matrix product over all real queries as the engine takes them. `implicit_mask`: no mask
    (every row a chain of the full width: the causal mask over slots)."""
    width = max(len(r.tokens) for r in rows)
    b = len(rows)
    tokens = torch.zeros(b, width, dtype=torch.long)
    positions = torch.zeros(b, width, dtype=torch.long)
    slots = torch.zeros(b, width, dtype=torch.long)
    kv_len = max(max(r.slots) for r in rows) + 1
    pad_from = [max(r.slots) + 1 for r in rows]
    kv_len = max(kv_len, max(p + width - len(r.tokens) for p, r in zip(pad_from, rows, strict=True)))
    mask = torch.zeros(b, width, kv_len, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r.tokens)
        tokens[i, :n], positions[i, :n], slots[i, :n] = (torch.tensor(r.tokens), torch.tensor(r.positions),
                                                          torch.tensor(r.slots))
        pad = torch.arange(pad_from[i], pad_from[i] + width - n)
        tokens[i, n:], positions[i, n:], slots[i, n:] = r.tokens[0], pad, pad
        for j in range(n):
            mask[i, j, r.visible(j)] = True
        mask[i, torch.arange(n, width), pad] = True
    if implicit_mask:
        assert all(r.sees is None and len(r.tokens) == width for r in rows)
    hidden = model(tokens, positions, cache, slots, None if implicit_mask else mask)
    real = torch.cat([hidden[i, : len(r.tokens)] for i, r in enumerate(rows)])
    logits = model.compute_logits(real)
    return list(logits.split([len(r.tokens) for r in rows]))


def others(model: Transformer, n: int, gen: torch.Generator, width: int, trees: bool) -> list[Row]:
    """n random rows: random prefix lengths and widths (up to `width`), chains or random trees."""
    vocab = model.config.vocab_size
    out = []
    for _ in range(n):
        t = int(torch.randint(1, width + 1, (1,), generator=gen))
        start = int(torch.randint(0, MAX_LEN - WIDEST - width, (1,), generator=gen))
        tokens = torch.randint(0, vocab, (t,), generator=gen).tolist()
        if not trees or t == 1 or bool(torch.randint(0, 3, (1,), generator=gen) == 0):
            out.append(Row.chain(tokens, start))
            continue
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        depth = [0] * t
        sees: list[list[int]] = []
        for i in range(t):
            depth[i] = 0 if i == 0 else depth[parents[i]] + 1
            chain, at = [], i
            while at >= 0:
                chain.append(start + at)
                at = parents[at]
            sees.append(list(range(start)) + sorted(chain))
        out.append(Row(tokens, [start + d for d in depth], list(range(start, start + t)), sees))
    return out


def one_at_a_time(model: Transformer, tokens: list[int], gen: torch.Generator) -> torch.Tensor:
    """The reference: logits [T, V] of each token decoded alone (batch of one, one token a forward)."""
    cache = new_cache(model, 1, gen)
    rows = [model.compute_logits(model(torch.tensor([[t]]), torch.tensor([[i]]), cache))[0] for i, t in
            enumerate(tokens)]
    return torch.cat(rows)
