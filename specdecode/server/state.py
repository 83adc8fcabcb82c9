"""What one app's routes share: the model, the engine thread, the metrics, the names served, the tokenizer
thread, the request timeout and the requests in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.llm import LLM
from specdecode.server.async_engine import AsyncEngine
from specdecode.server.errors import APIError
from specdecode.server.lifecycle import Lifecycle
from specdecode.server.logprobs_format import TokenText
from specdecode.server.metrics import ServerMetrics
from specdecode.server.structured import warm_grammar_engine


@dataclass(frozen=True)
class Limits:
    """The server's timeouts (docs/serving.md lists them with their flags)."""

    request_timeout_s: float | None = None
    """The longest a request may take (None: no limit); a request's own `timeout` may only shorten it."""
    stall_timeout_s: float | None = 60.0
    """/health answers 503 once one engine step has run this long (None or 0: never)."""


class ServerState:
    """The state of one app, built with it and shared by its routes."""

    def __init__(self, llm: LLM, engine: BatchEngine, served_model_name: str, aliases: set[str],
                 default_max_tokens: int, metrics: ServerMetrics, limits: Limits = Limits(),
                 on_engine_death: Callable[[int], None] | None = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self.limits = limits
        self.engine = AsyncEngine(engine, metrics, stall_timeout_s=limits.stall_timeout_s, on_death=on_engine_death)
        self.lifecycle = Lifecycle()
        self.model_name = served_model_name
        self.accepted_names = {served_model_name, *aliases}
        self.default_max_tokens = default_max_tokens
        self.vocab_size = llm.target.config.vocab_size
        self.created = int(time.time())
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdecode-tokenize")
        self.tokenize_pool.submit(warm_grammar_engine, llm.tokenizer, self.vocab_size)  # off the event loop
        self.token_text = TokenText(llm.tokenizer)
        self.preparing = 0  # requests checked against the queue and not yet in it (engine_requests._queue_place)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(400, f"model {model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", "model_not_found")

    async def run_tokenizer(self, fn: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn)
