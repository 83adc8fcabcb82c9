"""What a peer engine of the benchmark is: an object that lists its method names without loading anything, loads
its models in ``open()`` and hands the harness one ``generate(prompt_ids) -> output_ids`` callable per method
(`specdecode.bench.peers` lists the peers)."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GenerateFn = Callable[[list[int]], list[int]]


@dataclass
class PeerContext:
    target_path: Path
    """Resolved target: a .gguf file or a Hugging Face directory."""
    draft_path: Path | None
    """Resolved draft model for assisted generation, or None."""
    eos_token_id: int | None
    """The target tokenizer's EOS (the id our engine stops at)."""
    max_tokens: int
    temperature: float = 0.0
    dtype: torch.dtype = torch.bfloat16
    threads: int = 2
    seed: int = 0
    max_prompt_tokens: int = 0
    """Longest prompt of the run (llama.cpp's context is sized to fit it)."""


@dataclass
class PeerMethod:
    name: str
    generate: GenerateFn
    settings: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[], None] | None = None
    """Called once before the method's warm-up (sets per-method engine options)."""


class Peer:
    name = ""
    package = ""

    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        self.notes: list[str] = []

    def available(self) -> str | None:
        """None if the peer can run here; otherwise why not (a note)."""
        if importlib.util.find_spec(self.package) is None:
            return f"{self.name}: skipped, package {self.package!r} is not installed"
        return None

    def method_names(self) -> list[str]:
        raise NotImplementedError

    def open(self) -> list[PeerMethod]:
        raise NotImplementedError

    def close(self) -> None:
        gc.collect()
