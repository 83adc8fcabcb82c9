"""A request's output does not depend on what else runs: on the default CPU paths (our kernels) a token's logits
have the same bits however many tokens, rows or cached positions its forwards hold (tests/test_row_invariance.py
checks each path forward by forward), so a request gives the same tokens and logprobs alone or in a batch, with its
prompt prefilled whole or in chunks, from the prefix cache or not, with speculation on or off.

Batch-invariant mode (`LLM(batch_invariant=True)`) extends this to the torch fallbacks (fp32 without our kernels:
linears row by row, attention query by query at any length); with our kernels it changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.model import native_kernels
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


def _prompts(vocab: int) -> list[list[int]]:
    """8 prompts of 5 to 120 tokens (past the few-row forwards), some sharing a long prefix (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, vocab, (70,), generator=gen).tolist()
    out = []
    for i, n in enumerate([5, 120, 33, 90, 12, 67, 100, 48]):
        own = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append(shared[: n // 2] + own[: n - n // 2] if i % 2 else own)
    return out


def _bits(outputs: list) -> list:
    return [(o.token_ids, [(e.token_id, e.logprob, e.top) for e in o.logprobs or []]) for o in outputs]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize(("cls", "dtype", "spec", "params"), [
    (None, "bf16", None, GREEDY),
    (None, "bf16", None, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True,
                                        logprobs=1)),
    (None, "bf16", NGRAM, GREEDY),
    (None, "fp32", NGRAM, GREEDY),
    ("avx2", "bf16", None, GREEDY),
    ("avx512vnni", "bf16", NGRAM, GREEDY),
    ("avx2", "fp32", NGRAM, GREEDY),
], ids=["bf16-greedy", "bf16-sampled", "bf16-ngram", "fp32-ngram", "bf16-greedy@avx2", "bf16-ngram@avx512vnni",
        "fp32-ngram@avx2"])
def test_a_request_has_the_same_bits_alone_or_in_a_batch(tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          cls: str | None, dtype: str, spec: dict | None,
                                                          params: SamplingParams) -> None:
    """Default settings (no batch-invariant mode): 8 requests as one batch, their prompts prefilled in chunks
    of 32 tokens between the others' steps and partly from the prefix cache, against each request alone with
    no prefix cache, prefilled whole. `@CLASS`: the machine run as that CPU class (SPECDECODE_ISA), below
    AVX512-BF16: the AVX2 GEMM and attention kernels."""
    if cls is not None:
        monkeypatch.setenv("SPECDECODE_ISA", cls)
        if not native_kernels.avx2_available() or native_kernels.glue_library() is None:
            pytest.skip("no AVX2 kernels here")
    elif not native_kernels.available():
        pytest.skip("no AVX512-BF16 CPU or no C compiler")
    batch = LLM(str(tiny_qwen_dir), dtype=dtype, speculative_config=spec, max_num_batched_tokens=32)
    alone = LLM(str(tiny_qwen_dir), dtype=dtype, speculative_config=spec, enable_prefix_caching=False,
                max_num_batched_tokens=0)
    prompts = _prompts(batch.target.model.config.vocab_size)
    together = batch.generate(prompts, params)
    assert _bits(together) == _bits([alone.generate([p], params)[0] for p in prompts])
