"""What a request's output must match, in vLLM's `StructuredOutputsParams` shape (exactly one constraint).

Pure data: importing it needs no grammar engine. A JSON schema given as a dict is kept as canonical JSON
text, so the params (and the `SamplingParams` holding them) stay frozen and hashable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One of: a JSON schema, any JSON object, a regular expression, a choice of strings, a grammar
    (Lark, or GBNF as llama.cpp writes it)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (dict or JSON text)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect) or a GBNF grammar."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True, separators=(",", ":")))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """The constraint given: "json", "json_object", "regex", "choice" or "grammar"."""
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if self._given(name)]
        return given[0]

    def _given(self, name: str) -> bool:
        value = getattr(self, name)
        return bool(value) if name == "json_object" else value is not None

    def validate(self) -> None:
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if self._given(name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ValueError(f"structured_outputs json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs json must be a JSON schema object")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (None unless `json` is given)."""
        return None if self.json is None else json.loads(self.json)  # type: ignore[arg-type]
