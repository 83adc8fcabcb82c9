"""A request's structured-output fields -> `StructuredOutputsParams` (or a 400 naming the field).

OpenAI's ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` spellings all land on the
same params; a request may use one of them. The grammar is compiled on a grammar thread, off the event loop
and within `COMPILE_TIMEOUT_S`, before the request's sequences copy it: a schema or regex the grammar engine
refuses, or one whose compile runs past the time limit, is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specdecode.model.tokenizer import Tokenizer
from specdecode.server.errors import APIError
from specdecode.server.protocol import _StructuredFields
from specdecode.structured import StructuredOutputsParams
from specdecode.structured.matcher import compiled_grammar, ll_tokenizer

COMPILE_TIMEOUT_S = 5.0
"""The longest a request's grammar may take to compile (a wait for a free grammar thread included); past it a
400, while the compile runs on to its end on its thread, bounded by llguidance's limits."""
GRAMMAR_THREADS = 2
"""Compiles at once; llguidance releases the GIL while it compiles, so the event loop and the engine go on."""
_POOL = ThreadPoolExecutor(max_workers=GRAMMAR_THREADS, thread_name_prefix="specdecode-grammar")

_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param)
    return value


def structured_params(body: _StructuredFields, tools: StructuredOutputsParams | None = None
                      ) -> StructuredOutputsParams | None:
    """The request's constraint, or None (also for response_format {"type": "text"}); `tools` is the grammar
    of a required or named tool choice, which excludes any other constraint."""
    given = [f for f in _FIELDS if getattr(body, f) is not None]
    if body.response_format is not None and body.response_format.type == "text":
        given.remove("response_format")
    if tools is not None:
        if given:
            raise APIError(400, f"{given[0]} cannot be combined with a required or named tool_choice", given[0])
        return tools
    if len(given) > 1:
        raise APIError(400, f"give at most one structured-output field, got {', '.join(given)}", given[1])
    if not given:
        return None
    field = given[0]
    try:
        if field == "response_format":
            fmt = body.response_format
            assert fmt is not None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema",
                               "response_format.json_schema")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        if field == "structured_outputs":
            so = body.structured_outputs
            assert so is not None
            schema = None if so.json_ is None else _json_schema(so.json_, "structured_outputs.json")
            return StructuredOutputsParams(json=schema, json_object=so.json_object, regex=so.regex,
                                           choice=tuple(so.choice) if so.choice is not None else None,
                                           grammar=so.grammar)
        if field == "guided_json":
            assert body.guided_json is not None
            return StructuredOutputsParams(json=_json_schema(body.guided_json, field))
        if field == "guided_regex":
            return StructuredOutputsParams(regex=body.guided_regex)
        if field == "guided_choice":
            return StructuredOutputsParams(choice=tuple(body.guided_choice or ()))
        return StructuredOutputsParams(grammar=body.guided_grammar)
    except ValueError as exc:
        raise APIError(400, str(exc), field) from None


def constraint_field(body: _StructuredFields, tools: StructuredOutputsParams | None = None) -> str:
    """The request field a constraint comes from, as errors name it."""
    if tools is not None:
        return "tools"
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format.json_schema" if fmt.type == "json_schema" else "response_format"
    return next((f for f in _FIELDS if getattr(body, f) is not None), "structured_outputs")


async def compile_constraint(params: StructuredOutputsParams, field: str, tokenizer: Tokenizer,
                             vocab_size: int) -> None:
    """Compile the constraint's grammar on a grammar thread (the grammar engine keeps it for the request's
    sequences to copy); a grammar it refuses, or one whose compile runs past `COMPILE_TIMEOUT_S`, is a 400
    naming `field`. Other requests go on meanwhile: the event loop only waits."""
    loop = asyncio.get_running_loop()
    try:  # the tokenizer's view, built once per server (warmed at start), is no part of the time limit
        await loop.run_in_executor(None, ll_tokenizer, tokenizer, vocab_size)
        await asyncio.wait_for(loop.run_in_executor(_POOL, compiled_grammar, params, tokenizer, vocab_size),
                               COMPILE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(400, f"{field} is too complex: compiling its grammar exceeded {COMPILE_TIMEOUT_S:g} s",
                       field) from None
    except ValueError as exc:
        raise APIError(400, f"{field}: {str(exc).removeprefix('structured_outputs: ')}", field) from None


def warm_grammar_engine(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Build the grammar engine's view of the tokenizer (seconds on a large vocabulary) before the first
    constrained request needs it; nothing without the grammar engine installed."""
    try:
        ll_tokenizer(tokenizer, vocab_size)
    except ValueError:  # llguidance is not installed: constrained requests will say so
        pass
