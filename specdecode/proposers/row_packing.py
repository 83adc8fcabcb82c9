"""One forward for many rows of a proposer's own cache, each feeding a different number of tokens.

A batch proposer (draft model, EAGLE head) keeps one cache row per request. A step feeds every drafting
row something different: a catch-up over the tokens it has not seen, one chain token plus a guess, a tree
level. `pack` lays these ragged inputs out as one [B, M] forward over cache rows [0, B): each row's
queries see what its own mask says, and the padding queries (and rows with nothing to feed) write to a
slot of their own row that holds nothing valid and see only that slot, so they change no valid entry and
never make an empty softmax. Pure: tensors in, tensors out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class RowInput:
    """What one cache row feeds in a forward."""

    tokens: list[int] | torch.Tensor  # [m]
    positions: list[int] | torch.Tensor  # [m] rope positions
    slots: list[int] | torch.Tensor  # [m] cache slots
    mask: torch.Tensor | None = None
    """[m, w] bool over cache slots [0, w); None: causal over the slots (slot s sees [0, s])."""


@dataclass
class Packed:
    tokens: torch.Tensor  # [B, M]
    positions: torch.Tensor  # [B, M]
    slots: torch.Tensor  # [B, M]
    mask: torch.Tensor  # [B, M, S] bool
    lengths: list[int]
    """Real queries per row (0 for a row with nothing to feed); row r's outputs are [r, :lengths[r]]."""


def _row_mask(inp: RowInput, slots: torch.Tensor) -> torch.Tensor:
    if inp.mask is not None:
        return inp.mask
    width = int(slots.max()) + 1
    return torch.arange(width).unsqueeze(0) <= slots.unsqueeze(1)  # [m, w]


def pack(inputs: dict[int, RowInput], rows: int, scratch: list[int]) -> Packed:
    """inputs: cache row -> what it feeds (rows in [0, rows)); scratch[r]: a slot of row r past anything
    valid there, for rows with nothing to feed. A feeding row's padding writes to the first slot past its
    mask (its next tree node's or token's slot, scratch until then)."""
    m = max((len(inp.tokens) for inp in inputs.values()), default=1)
    slots_of = {r: torch.as_tensor(inp.slots, dtype=torch.long) for r, inp in inputs.items()}
    masks = {r: _row_mask(inp, slots_of[r]) for r, inp in inputs.items()}
    pad_slot = [masks[r].shape[1] if r in inputs else scratch[r] for r in range(rows)]
    width = max(max((mk.shape[1] for mk in masks.values()), default=0), max(pad_slot) + 1)
    tokens = torch.zeros(rows, m, dtype=torch.long)
    positions = torch.zeros(rows, m, dtype=torch.long)
    slots = torch.tensor(pad_slot, dtype=torch.long).unsqueeze(1).repeat(1, m)  # [B, M]
    mask = torch.zeros(rows, m, width, dtype=torch.bool)
    mask[torch.arange(rows), :, torch.tensor(pad_slot)] = True  # padding sees its own slot only
    lengths = [0] * rows
    for r, inp in inputs.items():
        n = len(inp.tokens)
        lengths[r] = n
        tokens[r, :n] = torch.as_tensor(inp.tokens, dtype=torch.long)
        positions[r, :n] = torch.as_tensor(inp.positions, dtype=torch.long)
        slots[r, :n] = slots_of[r]
        mask[r, :n] = False
        mask[r, :n, : masks[r].shape[1]] = masks[r]
    return Packed(tokens, positions, slots, mask, lengths)


ALONE_TOKENS = 16
"""A row feeding more tokens than this (a catch-up over a prompt) runs in a forward of its own: padding every
other row to its length would cost more than the second forward (a long forward is compute-bound anyway)."""


def forward_rows(feeds: dict[int, RowInput], span: int, scratch: list[int],
                 run: Callable[[int, int, Packed], torch.Tensor]) -> dict[int, torch.Tensor]:
    """Run feeds (cache row -> input) as few forwards: rows feeding up to ALONE_TOKENS together over cache rows
    [0, span), each longer one alone. `run(lo, hi, packed)` runs one forward over cache rows [lo, hi) (row r of
    the cache is row r - lo of `packed`) and returns its outputs [hi - lo, M, ...]. Returns each fed row's
    outputs at its real queries [m, ...]."""
    out = {}
    together = {r: f for r, f in feeds.items() if len(f.tokens) <= ALONE_TOKENS}
    scratch = list(scratch)
    for r, f in feeds.items():
        if r not in together:
            packed = pack({0: f}, 1, [0])
            out[r] = run(r, r + 1, packed)[0]
            scratch[r] = packed.mask.shape[-1] - 1  # its padding slot: past what it just wrote
    if together:
        packed = pack(together, span, scratch)
        res = run(0, span, packed)
        out.update({r: res[r, : packed.lengths[r]] for r in together})
    return out
