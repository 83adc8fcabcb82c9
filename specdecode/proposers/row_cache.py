"""The cache rows of a batch proposer: one row of its own KV cache per drafting request.

A request takes the lowest free row at `begin` and gives it back at `release`, so the rows in use stay
packed toward row 0 and a batched forward runs over rows [0, `span`). The cache grows (doubling, its rows
copied, up to the engine's batch size) when more requests draft at once than it has rows, unless `reserve`
allocated the engine's rows up front; it never shrinks.
"""

from __future__ import annotations

from collections.abc import Callable

from specdecode.model.kv_cache import KVCache


class RowCache:
    def __init__(self, new_cache: Callable[[int], KVCache], max_rows: int | None = None) -> None:
        self.new_cache = new_cache
        """rows -> an empty cache of that many rows."""
        self.max_rows = max_rows
        """Rows the cache grows to at most by doubling (the engine's batch size; its memory was checked)."""
        self.cache: KVCache | None = None
        self.used: set[int] = set()

    def take(self) -> int:
        row = next(r for r in range(len(self.used) + 1) if r not in self.used)
        self.used.add(row)
        if self.cache is None or row >= self.cache.batch_size:
            double = 2 * (self.cache.batch_size if self.cache is not None else 0)
            self._grow(max(row + 1, min(double, self.max_rows or double)))
        assert self.cache is not None
        self.cache.reset(row)
        return row

    def reserve(self, rows: int) -> None:
        """Grow to `rows` rows now (at most max_rows)."""
        rows = min(rows, self.max_rows or rows)
        if self.cache is None or self.cache.batch_size < rows:
            self._grow(rows)

    def give(self, row: int) -> None:
        self.used.discard(row)

    @property
    def span(self) -> int:
        """Rows a forward over every row in use covers."""
        return max(self.used, default=-1) + 1

    def _grow(self, rows: int) -> None:
        cache = self.new_cache(rows)
        old = self.cache
        if old is not None:
            cache.take_rows(old)
        self.cache = cache
