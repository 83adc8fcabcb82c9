"""A request's deadline: the server's `--request-timeout`, or the request's own `timeout` (seconds, at most the
server's). Past it a non-streamed request answers 408 and a stream ends with an error event; either way its
choices are aborted, which frees their rows and cache references before the engine's next step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from specdecode.server.errors import APIError, error_body

STATUS = 408
CODE = "request_timeout"


@dataclass(frozen=True)
class Deadline:
    seconds: float
    at: float
    """The event loop's time (`loop.time()`) by which the request must have finished."""

    @property
    def message(self) -> str:
        return f"the request did not finish within its timeout of {self.seconds:g} s"

    def error(self) -> APIError:
        return APIError(STATUS, self.message, None, CODE)

    def event_body(self) -> dict:
        """The error event that ends a stream past its deadline."""
        return error_body(STATUS, self.message, None, CODE)


def request_deadline(server_limit: float | None, asked: float | None) -> Deadline | None:
    """The deadline of a request arriving now (None: no limit); a `timeout` over the server's limit is a 400."""
    if asked is not None and server_limit is not None and asked > server_limit:
        raise APIError(400, f"timeout ({asked:g} s) exceeds this server's limit of {server_limit:g} s "
                            "(--request-timeout)", "timeout")
    seconds = asked if asked is not None else server_limit
    if seconds is None:
        return None
    return Deadline(seconds, asyncio.get_running_loop().time() + seconds)


@asynccontextmanager
async def within(deadline: Deadline | None) -> AsyncIterator[None]:
    """Run the block under the deadline: past it, the block is cancelled (its requests aborted on the way out)
    and the 408 APIError raised."""
    if deadline is None:
        yield
        return
    timer = asyncio.timeout_at(deadline.at)
    try:
        async with timer:
            yield
    except TimeoutError:
        if timer.expired():
            raise deadline.error() from None
        raise
