"""Sibling choices share one prompt prefill: the `n` choices of a request form a prefill group, queued one
behind the other. The first prefills the prompt; each next one copies that row's prompt K/V (the partial last
block included) and features, and draws its first token from the same logits, while the source row still
runs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdecode.engine.running import Running
from specdecode.engine.sequence import Sequence
from specdecode.model.kv_cache import KVCache


@dataclass
class SharedPrefill:
    source: Running
    logits: torch.Tensor  # [1, V] at the prompt's last position


class PrefillShares:
    """Finished prefills by prefill group, kept while their source runs and a sibling may still follow."""

    def __init__(self) -> None:
        self._by_group: dict[object, SharedPrefill] = {}

    def offer(self, source: Running, logits: torch.Tensor) -> None:
        """source finished its prompt's prefill, with logits [1, V] at its last position."""
        if source.seq.prefill_group is not None:
            self._by_group[source.seq.prefill_group] = SharedPrefill(source, logits)

    def take(self, seq: Sequence, next_waiting: Sequence | None) -> SharedPrefill | None:
        """The prefill seq's group shares, if any; the last sibling (none of its group waits behind it) takes
        it for good."""
        group = seq.prefill_group
        done = self._by_group.get(group) if group is not None else None
        if done is not None and (next_waiting is None or next_waiting.prefill_group is not group):
            del self._by_group[group]
        return done

    def copy_into(self, r: Running, row: int, running: list[Running], next_waiting: Sequence | None,
                  cache: KVCache, features: bool) -> SharedPrefill | None:
        """Copy the prefill r's group shares into `row` of `cache`: its source's prompt K/V, while the source
        still runs with the same prompt (and has the features, where r's proposer reads them). Returns the
        share (its logits give r's first token; its source's features those of r's prompt), or None."""
        seq = r.seq
        done = self.take(seq, next_waiting)
        if done is None:
            return None
        source = done.source
        src = next((i for i, x in enumerate(running) if x is source), -1)
        if (src < 0 or source.seq.token_ids[: seq.prompt_len] != seq.token_ids
                or (features and (source.features is None or source.policy is None))):
            return None
        r.started = time.perf_counter()
        cache.copy_prefix(src, row, seq.prompt_len)
        cache.set_length(row, seq.prompt_len)
        r.prefilled = seq.prompt_len
        seq.cached_tokens = source.seq.cached_tokens  # the one prompt prefill the choices share
        return done

    def __len__(self) -> int:
        return len(self._by_group)

    def forget(self, source: Running) -> None:
        """source's row is gone: siblings still waiting prefill on their own."""
        group = source.seq.prefill_group
        if group is not None and group in self._by_group and self._by_group[group].source is source:
            del self._by_group[group]
