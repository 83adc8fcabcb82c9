"""Static, slot-indexed KV cache. The cache owns lengths and rollback.

Entries are written at explicit *slots*; for a chain slot == position, for a tree the
nodes of one step occupy consecutive slots while their rope positions repeat by depth.
Rejecting draft tokens is a length change (`truncate`), never a copy; after a tree step
`compact` moves the accepted path's entries into place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class CacheSlots(NamedTuple):
    """Where one forward writes its K/V: `index` [B, T] cache slots; `start` when they are one row's
    contiguous run (then each layer writes a slice); `end` = 1 + the highest slot. Worked out once per
    forward from one read of the slots: on a GPU each read waits for the device, and a check in every
    layer's write would stall every layer."""

    index: torch.Tensor
    start: int | None
    end: int

    @classmethod
    def of(cls, slots: torch.Tensor) -> CacheSlots:
        b, t = slots.shape
        if b != 1:
            return cls(slots, None, int(slots.max()) + 1)
        host = slots[0].tolist()
        # Every step must be +1: equal end points alone let e.g. [3, 5, 4] through.
        contiguous = all(nxt - cur == 1 for cur, nxt in zip(host, host[1:], strict=False))
        return cls(slots, host[0] if contiguous else None, max(host) + 1)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, kvh, S, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * batch_size
        """Valid prefix length per row: slots [0, length) hold the sequence's tokens."""
        self.pos = torch.zeros(batch_size, max_len, dtype=torch.int64, device=device)
        """The rope position of each slot's entry [B, S], written by models with a sliding window (which
        masks by position distance) and moved with the entries."""

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor | CacheSlots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [B, kvh, T, hd] at slots [B, T] of `layer`."""
        if isinstance(slots, torch.Tensor):
            slots = CacheSlots.of(slots)
        b, t = slots.index.shape
        if slots.start is not None:  # contiguous single-row write (the common chain case): a slice copy
            self.k[layer, :, :, slots.start : slots.start + t] = k
            self.v[layer, :, :, slots.start : slots.start + t] = v
            return
        index = slots.index
        rows = torch.arange(b, device=index.device).unsqueeze(1).expand(b, t)
        # Index a [B, S, kvh, hd] view so advanced indexing writes through to storage.
        self.k[layer].transpose(1, 2)[rows, index] = k.transpose(1, 2)
        self.v[layer].transpose(1, 2)[rows, index] = v.transpose(1, 2)

    def write_positions(self, slots: CacheSlots, positions: torch.Tensor) -> None:
        """Record the rope positions [B, T] of the entries written at `slots`."""
        if slots.start is not None:
            self.pos[:, slots.start : slots.start + positions.shape[1]] = positions
            return
        rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1).expand_as(positions)
        self.pos[rows, slots.index] = positions

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every slot of `layer`: [B, kvh, S, hd] views, for kernels that write in place."""
        return self.k[layer], self.v[layer]

    def read(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, kv_len): [B, kvh, kv_len, hd] views."""
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def set_length(self, row: int, n: int) -> None:
        if not 0 <= n <= self.max_len:
            raise ValueError(f"cache length {n} outside [0, {self.max_len}]")
        self.lengths[row] = n

    def truncate(self, n: int, row: int = 0) -> None:
        """Forget everything from slot n on (rejected drafts): a length change only."""
        if n > self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} from {self.lengths[row]} up to {n}")
        self.lengths[row] = n

    def compact(self, row: int, src_slots: list[int], dst_start: int) -> None:
        """Move the entries at `src_slots` to dst_start.. (accepted tree path)."""
        if not src_slots:
            return
        src = torch.tensor(src_slots, device=self.k.device)
        n = len(src_slots)
        self.k[:, row, :, dst_start : dst_start + n] = self.k[:, row, :, src]
        self.v[:, row, :, dst_start : dst_start + n] = self.v[:, row, :, src]
        self.pos[row, dst_start : dst_start + n] = self.pos[row, src]

    def read_span(self, row: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row's K and V at slots [start, start + n): [L, kvh, n, hd] each (for the prefix cache)."""
        return self.k[:, row, :, start : start + n].clone(), self.v[:, row, :, start : start + n].clone()

    def write_span(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [L, kvh, n, hd] at row's slots [start, start + n) (a prefix-cache hit); a prefix's
        entries sit at their own positions."""
        n = k.shape[2]
        self.k[:, row, :, start : start + n] = k
        self.v[:, row, :, start : start + n] = v
        self.pos[row, start : start + n] = torch.arange(start, start + n, device=self.pos.device)

    def reset(self, row: int | None = None) -> None:
        if row is None:
            self.lengths = [0] * self.batch_size
        else:
            self.lengths[row] = 0

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows [start, stop) sharing this one's storage (a batch of running sequences)."""
        view = object.__new__(KVCache)
        view.k = self.k[:, start:stop]
        view.v = self.v[:, start:stop]
        view.pos = self.pos[start:stop]
        view.max_len = self.max_len
        view.lengths = self.lengths[start:stop]  # a copy: the owner keeps the authoritative lengths
        return view

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy row src's first n entries into row dst (choices of one prompt share its prefill); dst's
        length is the caller's to set."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.pos[dst, :n] = self.pos[src, :n]

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src's valid entries into row dst (keeps running sequences in rows 0..n-1)."""
        n = self.lengths[src]
        self.copy_prefix(src, dst, n)
        self.lengths[dst] = n
        self.lengths[src] = 0

    def take_rows(self, old: KVCache) -> None:
        """Copy every row of a smaller cache (entries, positions and lengths) into this one's first rows."""
        n = old.batch_size
        self.k[:, :n], self.v[:, :n] = old.k, old.v
        self.pos[:n] = old.pos
        self.lengths[:n] = old.lengths
