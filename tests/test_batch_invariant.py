"""Batch-invariant mode (`LLM(batch_invariant=True)`): every token of a forward is computed as if alone, so its
logits have the same bits however many tokens, rows or cached positions the forward holds; logprobs are then
identical with speculation on or off (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.model.load import load_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _logits(model: torch.nn.Module, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position [T, V], the prompt fed in chunks of the given sizes."""
    cache = model.new_cache(2, 128)
    out, at = [], 0
    for n in chunks:
        ids = torch.tensor([tokens[at : at + n]] * 2)  # two rows: a batch, not one sequence
        pos = torch.arange(at, at + n).expand(2, n)
        out.append(model.compute_logits(model(ids, pos, cache))[0])
        at += n
    return torch.cat(out)


@pytest.mark.parametrize("dir_fixture", ["tiny_llama_dir", "tiny_qwen_dir"])
def test_a_tokens_logits_do_not_depend_on_the_forward(dir_fixture: str, request: pytest.FixtureRequest) -> None:
    model = load_model(str(request.getfixturevalue(dir_fixture)), "fp32", "cpu").model
    rng = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, model.config.vocab_size, (80,), generator=rng).tolist()
    model.make_batch_invariant()
    one_by_one = _logits(model, tokens, [1] * 80)
    for chunks in ([80], [16] * 5, [3, 70, 7]):  # a long prompt (attention past the few-row limit) and chunks
        assert torch.equal(_logits(model, tokens, chunks), one_by_one), chunks


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft", "model": "TINY", "num_speculative_tokens": 3, "draft_tree_width": 2},
])
def test_logprobs_have_the_same_bits_with_speculation_on_and_off(spec: dict, tiny_llama_dir: Path) -> None:
    spec = {**spec, "model": str(tiny_llama_dir)} if spec.get("model") == "TINY" else spec
    prompts = ["def add(a, b): return a + b\ndef add(", "import numpy as np\nimport numpy", "hello hello hello"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    plain = LLM(str(tiny_llama_dir), dtype="fp32", batch_invariant=True)
    fast = LLM(str(tiny_llama_dir), dtype="fp32", batch_invariant=True, speculative_config=spec)
    want, got = plain.generate(prompts, params), fast.generate(prompts, params)
    assert sum(o.metrics["accepted_tokens"] for o in got) > 0
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [(e.token_id, e.logprob, e.top) for e in g.logprobs or []] == \
            [(e.token_id, e.logprob, e.top) for e in w.logprobs or []]


def test_batch_invariant_mode_needs_fp32(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch_invariant needs dtype='fp32'"):
        LLM(str(tiny_llama_dir), dtype="bf16", batch_invariant=True)
