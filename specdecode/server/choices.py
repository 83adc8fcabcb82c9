"""The `n` choices of one request: their streams as one, their usage counted once for the prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from specdecode.server.async_engine import RequestStream, Update
from specdecode.server.protocol import PromptTokensDetails, SpeculativeUsage, Usage


class ChoiceGroup:
    """One request's choices (each a `RequestStream` of its own row); ``close()`` aborts every unfinished one."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self.prompt_tokens = streams[0].prompt_tokens

    def close(self) -> None:
        for s in self.streams:
            s.close()

    async def updates(self) -> AsyncIterator[tuple[int, Update]]:
        """(choice index, update) in arrival order, until every choice has finished or failed."""
        if len(self.streams) == 1:
            async for update in self.streams[0]:
                yield 0, update
            return
        queue: asyncio.Queue[tuple[int, Update | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for update in stream:
                    await queue.put((i, update))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            live = len(tasks)
            while live:
                i, update = await queue.get()
                if update is None:
                    live -= 1
                else:
                    yield i, update
        finally:
            for t in tasks:
                t.cancel()

    def usage(self, finals: list[Update]) -> dict[str, Any]:
        """The prompt once (its cached tokens those of the choices' one shared prefill), every choice's tokens;
        the speculative stats summed over the choices."""
        completion = sum(f.num_output for f in finals)
        stats = merge_stats([f.stats for f in finals])
        cached = PromptTokensDetails(cached_tokens=self.streams[0].seq.cached_tokens)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion, prompt_tokens_details=cached,
                     speculative=SpeculativeUsage.from_stats(stats)).model_dump()


def merge_stats(stats: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """`SpecStats.to_dict()` of several requests as one: counts summed, ratios recomputed from the sums."""
    given = [s for s in stats if s is not None]
    if len(given) <= 1:
        return given[0] if given else None
    total = {k: sum(s[k] for s in given) for k in ("steps", "draft_tokens", "accepted_tokens", "output_tokens")}
    depth = max(len(s["acceptance_by_position"]) for s in given)
    by_pos = [sum(s["acceptance_by_position"][i] for s in given if i < len(s["acceptance_by_position"]))
              / sum(1 for s in given if i < len(s["acceptance_by_position"])) for i in range(depth)]
    return {**total,
            "mean_accepted_length": total["output_tokens"] / total["steps"] if total["steps"] else 0.0,
            "acceptance_rate": total["accepted_tokens"] / total["draft_tokens"] if total["draft_tokens"] else 0.0,
            "acceptance_by_position": by_pos}
