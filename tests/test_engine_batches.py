"""Greedy exactness through the one engine, fp32: every method, in batches of 1 to 8 requests that join
and leave at different lengths, gives each request plain decoding's tokens.

Requests differ in prompt and max_tokens (so rows leave at different steps and the last row moves into
a freed one), and join while others run (a new row's prefill between two batch steps). Drafters: n-gram, a
draft model as chain and as tree (with the prompt-lookup branch), Medusa heads and an EAGLE tree with and
without the lookup branch, the draft model and the heads drafting every row in one forward per level; random
heads and a random draft reject most drafts, the target as its own draft accepts them all, so both full and
partial acceptance run in the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.core import Engine
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.eagle_rows import EagleRows
from specdecode.proposers.medusa_rows import MedusaRows

MAX_TOKENS = [24, 9, 17, 30, 5, 21, 13, 28]
TEXTS = ["def add(a, b):", "The quick brown fox", "x = [1, 2, 3]\nfor i in x:", "Hello", "a b a b a b a",
         "import os\nimport sys\n", "1, 2, 3, 4, 5,", "class A:\n    def f(self):"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and plain greedy outputs, one request at a time."""
    plain = LLM(str(tiny_llama_dir), dtype="fp32")
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    outs = [plain.generate([p], _params(n))[0].token_ids for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    return prompts, outs


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _methods(tiny: Path, other: Path, heads: dict[str, Path]) -> dict[str, dict[str, Any]]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft-chain": {"method": "draft", "model": str(tiny), "num_speculative_tokens": 4},
        "draft-tree": {"method": "draft", "model": str(other), "num_speculative_tokens": 3, "draft_tree_width": 2},
        "medusa": {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3},
        "eagle-tree-lookup": {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 4,
                              "draft_tree_width": 0, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        "eagle-tree": {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 4,
                       "draft_tree_width": 3, "draft_prompt_lookup": False},
    }


def _run(llm: LLM, engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Half the requests at once, then one more every second step: rows join while others run."""
    seqs = [llm.new_sequence(p, _params(n)) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    pending = list(seqs)
    for s in pending[: len(pending) // 2]:
        engine.add(s)
    pending = pending[len(pending) // 2 :]
    steps = 0
    while engine.has_work() or pending:
        if pending and steps % 2 == 0:
            engine.add(pending.pop(0))
        engine.step()
        steps += 1
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("method", ["ngram", "draft-chain", "draft-tree", "medusa", "eagle-tree-lookup",
                                    "eagle-tree"])
def test_every_method_in_batches_equals_plain(method: str, tiny_llama_dir: Path, tiny_llama_other_dir: Path,
                                              tiny_heads: dict[str, Path], reference) -> None:  # noqa: ANN001
    prompts, ref = reference
    spec = _methods(tiny_llama_dir, tiny_llama_other_dir, tiny_heads)[method]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    batched = {"draft": DraftModelRows, "eagle": EagleRows, "medusa": MedusaRows}.get(spec["method"])
    assert batched is None or isinstance(llm.engine.proposer, batched)  # every row drafted in one forward a level
    for rows in (1, 3, 8):
        engine = llm.batch_engine(max_num_seqs=rows)
        assert _run(llm, engine, prompts) == ref, (method, rows)
    # LLM.generate: every prompt submitted at once, one batch
    long = [0, 2, 3, 5, 7]  # max_tokens >= 12
    outs = [o.token_ids for o in llm.generate([prompts[i] for i in long], _params(12))]
    assert outs == [ref[i][:12] for i in long]


def test_trees_are_verified_in_the_batch(tiny_llama_dir: Path, tiny_heads: dict[str, Path], reference) -> None:  # noqa: ANN001
    """Served rows draft trees (more nodes than positions), not chains."""
    prompts, ref = reference
    spec = _methods(tiny_llama_dir, tiny_llama_dir, tiny_heads)["eagle-tree"]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    engine = llm.batch_engine(max_num_seqs=4)
    seqs = [llm.new_sequence(p, _params(n)) for p, n in zip(prompts[:4], MAX_TOKENS[:4], strict=True)]
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == ref[:4]
    assert all(s.stats.draft_tokens > sum(s.stats.drafted_by_position) for s in seqs)  # nodes > positions
