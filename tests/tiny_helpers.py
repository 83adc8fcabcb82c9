"""Prompts and greedy parameters shared by the tests that compare speculative output with plain output
on the tiny random models (the plain reference itself is the `plain_tiny` fixture in conftest)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from specdecode import LLM, SamplingParams
from specdecode.engine.core import Engine
from specdecode.engine.sequence import Sequence
from specdecode.proposers.base import Draft, ProposeRow, SequenceView
from specdecode.proposers.ngram import NgramRows

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def tiny_prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode("def add(a, b):"), llm.tokenizer.encode("The quick brown fox")]


def run_batched(llm: LLM, prompts: list[list[int]], params: SamplingParams, max_num_seqs: int = 2,
                engine: Engine | None = None) -> list[Sequence]:
    """Every prompt through the continuous-batching engine (a new one, or `engine` as a test set it up), stepped
    until done; the finished sequences."""
    engine = engine if engine is not None else llm.batch_engine(max_num_seqs=max_num_seqs)
    seqs = [llm.new_sequence(p, params) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return seqs


def copy_with_vocab_rows(src: Path, dst: Path, extra: int, head_fill: float = 0.0) -> Path:
    """Same tokenizer, embedding and output rows padded by `extra` (as checkpoints pad to a multiple of 64/128;
    new output rows filled with `head_fill`, so a large value makes a padding row win every argmax if it were
    ever proposed); a negative `extra` cuts rows instead."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vocab_size"] += extra
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, fill in (("model.embed_tokens.weight", 0.0), ("lm_head.weight", head_fill)):
            if name in tensors:
                w = tensors[name]
                pad = torch.full((max(extra, 0), w.shape[1]), fill, dtype=w.dtype)
                tensors[name] = torch.cat([w[: w.shape[0] + min(extra, 0)], pad])
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def record_rows(llm: LLM) -> list:
    """The list every request `llm.generate` drafts for from now on appends its drafting state to, when the
    engine's batch proposer releases its row (to inspect after the request finished)."""
    proposer: Any = llm.engine.proposer
    assert proposer is not None
    made: list = []
    release = proposer.release

    def keep(key: int) -> None:
        if key in proposer.rows:
            made.append(proposer.rows[key])
        release(key)

    proposer.release = keep
    return made


class SequenceDrafter(Protocol):
    """A test's drafter for one sequence at a time (an oracle that knows the target's output)."""

    name: str

    def begin(self, seq: SequenceView) -> None: ...

    def propose(self, seq: SequenceView, k: int, node_budget: int) -> Draft: ...

    def on_verified(self, seq: SequenceView, num_accepted: int, own_accepted: int) -> None: ...


class DrafterRows(NgramRows):
    """A `BatchProposer` of chains over per-sequence test drafters: `factory()` makes each row's drafter at
    `begin`. Free like the n-gram proposer (no cost, no cache, no catch-up), it reads no hidden states."""

    def __init__(self, factory: Callable[[], SequenceDrafter]) -> None:
        self.factory = factory
        self.name = factory().name
        self.rows: dict[int, SequenceDrafter] = {}

    def begin(self, key: int, seq: SequenceView) -> None:
        self.rows[key] = self.factory()
        self.rows[key].begin(seq)

    def release(self, key: int) -> None:
        self.rows.pop(key, None)

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        return [self.rows[r.key].propose(r.seq, r.k, r.node_budget) for r in rows]

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        self.rows[key].on_verified(seq, num_accepted, own_accepted)
