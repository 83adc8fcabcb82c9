"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, and GET /version.

/tokenize takes a completion prompt or chat messages (the chat template applied, as a chat
completion would see them) and answers the ids a request would start from; /detokenize turns
ids back into text. Both run on the server's tokenizer thread, off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from specdecode import __version__
from specdecode.server.engine_requests import check_message_count
from specdecode.server.errors import APIError
from specdecode.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)


def tokenizer_router(server: Any) -> APIRouter:
    """Routes over `server` (the app's `ServerState`: model check, tokenizer thread, the LLM)."""
    router = APIRouter()
    tokenizer = server.llm.tokenizer

    def strs(ids: list[int], wanted: bool) -> list[str | None] | None:
        return [tokenizer.id_to_token(t) for t in ids] if wanted else None

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt" if body.prompt is None else "messages")
        if body.messages is not None:
            check_message_count(body.messages)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            if not body.add_generation_prompt:
                raise APIError(400, "add_generation_prompt: false is not supported", "add_generation_prompt")
            encode, field = (lambda: server.llm.chat_prompt_ids(messages)), "messages"
        else:
            text = body.prompt
            if not body.add_special_tokens:
                raise APIError(400, "add_special_tokens: false is not supported", "add_special_tokens")
            encode, field = (lambda: tokenizer.encode(text)), "prompt"
        try:
            ids = await server.run_tokenizer(encode)
        except Exception as exc:  # a template may reject a conversation; bad Unicode cannot be encoded
            raise APIError(400, f"cannot tokenize {field}: {exc}", field) from None
        return TokenizeResponse(count=len(ids), max_model_len=server.llm.max_model_len, tokens=ids,
                                token_strs=strs(ids, body.return_token_strs))

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(body.model)
        bad = next((i for i, t in enumerate(body.tokens) if t >= server.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {body.tokens[bad]} is outside the vocabulary ({server.vocab_size})",
                           f"tokens[{bad}]")
        text = await server.run_tokenizer(lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
        return DetokenizeResponse(prompt=text)

    @router.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    return router
