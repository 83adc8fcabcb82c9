"""Request and response models of the OpenAI-compatible API (OpenAI's field names).

Numbers are strict (no "10" for 10, no true for 1; an integer is fine where a float is expected),
NaN and infinities are refused, and ranges match ``SamplingParams``'s, so bad input fails
validation (a 400) before any engine work. A field the server does not know or does not implement
is a 400 naming it, as OpenAI's own API answers ("Unrecognized request argument supplied: X"), never
silently ignored. ``user``, ``metadata``, ``store`` and ``service_tier`` are accepted as metadata
only: they change nothing in the generation. Extensions beyond OpenAI: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``speculative``, ``cache_salt``, and vLLM's
structured-output spellings (``structured_outputs``, ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Bounds that keep a request's work and the server's memory reasonable; the context length and the
# 1 MB body limit bound the rest.
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_TOKENS_LIMIT = 1 << 20
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_CHOICES = 16
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20
MAX_CACHE_SALT = 1024

Float = StrictFloat | StrictInt  # JSON 1 is a fine temperature


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Request(BaseModel):
    """A request part: an unknown field is an error (it would otherwise be silently dropped)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SpeculativeOptions(_Request):
    """Per-request speculation: ``{"num_speculative_tokens": 0}`` turns it off for this request."""

    num_speculative_tokens: Annotated[StrictInt, Field(ge=0, le=32)] | Literal["auto"] | None = Field(
        None, description="Draft length k for this request (0 = no speculation; capped at the server's k), "
                          "or \"auto\"/null for the server's policy.")


class StreamOptions(_Request):
    include_usage: StrictBool | None = False


JsonObject = dict[StrictStr, Any]


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsOptions(_Request):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: JsonObject | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1, max_length=1024)] | None = None
    grammar: StrictStr | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class _StructuredFields(_Request):
    """Structured outputs, OpenAI's and vLLM's spellings (at most one per request)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: JsonObject | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: StrictStr | None = None


class _SamplingFields(_StructuredFields):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = Field(None, description="The served model name (see GET /v1/models).")
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = Field(
        None, description="Default: the remaining context, capped at the server's --default-max-tokens (256).")
    temperature: Annotated[Float, Field(ge=0.0, le=100.0)] | None = Field(None, description="Default 1; 0 = greedy.")
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None, description="Independent choices of the same prompt (its prefill is shared); usage counts the "
                          "prompt once and every choice's tokens.")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(max_length=MAX_STOP_LEN)]],
                                Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    # metadata only: accepted and not used by the generation
    user: StrictStr | None = None
    metadata: Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    # extensions (vLLM names)
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: StrictBool | None = False
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=256)] | None = None
    speculative: SpeculativeOptions | None = None
    timeout: Annotated[Float, Field(gt=0.0)] | None = Field(
        None, description="Extension: seconds this request may take, at most the server's --request-timeout; past "
                          "it a 408 (a stream: an error event). Default: the server's --request-timeout.")
    logit_bias: Annotated[dict[StrictStr, Annotated[Float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to the logits.")
    min_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = Field(
        None, description="vLLM extension: EOS and stop_token_ids are masked until this many tokens.")
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = Field(
        None, description="vLLM extension: the prefix-cache namespace; only requests with the same salt share "
                          "cached prompt blocks (none: the shared namespace). Use a long random secret per tenant.")


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)] = Field(
        ..., description="Text or token ids (one prompt per request; a list holding one prompt is accepted).")
    echo: StrictBool | None = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="Report each token's logprob and this many most likely alternatives.")
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Request):
    name: StrictStr
    arguments: StrictStr


class ToolCallIn(_Request):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextPart], Field(max_length=1024)] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None
    """An assistant turn's calls."""
    tool_call_id: StrictStr | None = None
    """A tool turn: the call it answers."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: StrictStr | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="Alternatives per token (needs logprobs: true).")


# ---- responses ----------------------------------------------------------------------------------------


class SpeculativeUsage(_Model):
    """Per-request speculative-decoding stats (the ``usage.speculative`` extension)."""

    steps: int = Field(description="Target forwards of this request (its prefill included).")
    draft_tokens: int = 0
    accepted_tokens: int = 0
    mean_accepted_length: float = Field(0.0, description="Output tokens per step (1.0 = no speculation gain).")
    acceptance_rate: float = 0.0
    acceptance_by_position: list[float] = Field(default_factory=list)

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> SpeculativeUsage | None:
        if stats is None:
            return None
        return cls(**{k: stats[k] for k in cls.model_fields if k in stats})


class PromptTokensDetails(_Model):
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of prefilled (OpenAI's field)."""


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Model):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Model):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Model):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallOut(_Model):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str] = Field(description="{\"name\": ..., \"arguments\": JSON text}")


class ChatMessageOut(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Model):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdecode"
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


# ---- tokenizer endpoints (vLLM's shapes) ---------------------------------------------------------------


class TokenizeRequest(_Request):
    """Either a completion ``prompt`` or chat ``messages`` (the chat template applied), not both."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=MAX_TOKENS_LIMIT)]


class DetokenizeResponse(_Model):
    prompt: str


class VersionResponse(_Model):
    version: str
