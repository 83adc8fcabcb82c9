"""What one app's routes share: the model, the engine thread, the metrics, the names served and the tokenizer
thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.llm import LLM
from specdecode.server.async_engine import AsyncEngine
from specdecode.server.errors import APIError
from specdecode.server.logprobs_format import TokenText
from specdecode.server.metrics import ServerMetrics
from specdecode.server.structured import warm_grammar_engine


class ServerState:
    """The state of one app, built with it and shared by its routes."""

    def __init__(self, llm: LLM, engine: BatchEngine, served_model_name: str, aliases: set[str],
                 default_max_tokens: int, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.metrics = metrics
        self.engine = AsyncEngine(engine, metrics)
        self.model_name = served_model_name
        self.accepted_names = {served_model_name, *aliases}
        self.default_max_tokens = default_max_tokens
        self.vocab_size = llm.target.config.vocab_size
        self.created = int(time.time())
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdecode-tokenize")
        self.tokenize_pool.submit(warm_grammar_engine, llm.tokenizer, self.vocab_size)  # off the event loop
        self.token_text = TokenText(llm.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(400, f"model {model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", "model_not_found")

    async def run_tokenizer(self, fn: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn)
