"""Greedy equivalence, exact, fp32: speculative output == plain greedy output, token for token.

docs/design.md. Every proposer (draft model, n-gram) and three drafters:

- the target itself as draft model: every draft token is accepted;
- a random model of the same vocabulary: (almost) nothing is accepted;
- an *oracle* that returns the target's true greedy continuation (precomputed by plain
  decoding) with the token at draft position j corrupted: every step accepts exactly j
  tokens, so each j exercises a different partial-acceptance path (cache rollback, the
  recovered token, the draft model's catch-up is not involved).

for fixed k = 1..8 and "auto", on tiny random Llama/Qwen2 models and (marker `real`) on
SmolLM2-135M. Each LLM is built once per module; drafters are swapped through
``llm.engine.set_proposer`` (a batch proposer; the oracle through ``tiny_helpers.DrafterRows``) and the
draft length through ``llm.engine.fixed_k`` / ``k_max``. Prompts given together run as one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_helpers import DrafterRows

from specdecode import LLM, SamplingParams
from specdecode.cost_model import CostModel
from specdecode.model.config import ModelConfig
from specdecode.model.load import load_model
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Draft, SequenceView
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.ngram import NgramRows

KS = [1, 2, 3, 4, 5, 6, 7, 8]
KS_AUTO: list[int | str] = [*KS, "auto"]
AUTO_COST = CostModel.from_points({1: 0.010, 9: 0.012}, 9, draft_step_seconds=0.001)
MAX_TOKENS = 40  # >= 5 verify steps even at k = 8 with everything accepted
TINY_PROMPTS: list[str | list[int]] = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
# n-gram needs repeats to draft anything: a prompt that repeats itself, given as token ids.
NGRAM_EXTRA_IDS = [17, 86, 70, 16, 289, 17, 86, 70, 16, 289, 17, 86]


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    """Overrides conftest's: one thread. These models are small enough that a second OpenMP thread
    only adds synchronisation, and on a loaded 2-core machine it makes forwards ~10x slower."""
    torch.set_num_threads(1)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class OracleProposer:
    """Drafts the target's true greedy continuation, with draft position ``corrupt_at`` wrong.

    ``references`` maps prompt ids to the plain greedy output for them. Records every draft so
    the test can predict the verifier's counts: with the corruption at j, a step drafting d
    tokens accepts exactly min(j, d).
    """

    name = "oracle"

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, corrupt_at: int | None) -> None:
        self.references = references
        self.vocab_size = vocab_size
        self.corrupt_at = corrupt_at
        self.ref: list[int] = []
        self.draft_lens: list[int] = []
        self.verified: list[int] = []

    def begin(self, seq: SequenceView) -> None:
        self.ref = self.references[tuple(seq.token_ids[: seq.prompt_len])]
        self.draft_lens = []
        self.verified = []

    def propose(self, seq: SequenceView, k: int, node_budget: int) -> Draft:
        done = len(seq.token_ids) - seq.prompt_len
        # The engine must never have emitted anything but the true greedy tokens.
        assert seq.token_ids[seq.prompt_len :] == self.ref[:done]
        tokens = list(self.ref[done : done + k])
        j = self.corrupt_at
        if j is not None and j < len(tokens):
            tokens[j] = (tokens[j] + 1) % self.vocab_size
        self.draft_lens.append(len(tokens))
        return Draft(tokens)

    def on_verified(self, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        self.verified.append(num_accepted)

    def expected_accepted(self) -> list[int]:
        j = self.corrupt_at
        return [d if j is None else min(j, d) for d in self.draft_lens]


def use(llm: LLM, proposer: Any, k: int | str) -> None:
    """Swap the drafter (a factory of batch proposers, or one oracle every request shares) and the draft length
    of an LLM built with a speculative config."""
    engine = llm.engine
    if k == "auto":
        assert engine.cost is not None, "build the LLM with num_speculative_tokens='auto' so the cost is measured"
        # A known cost (verifying 9 tokens costs little more than 1, a drafted token a tenth of a forward)
        # instead of the measured one: on tiny models the measured costs sit near break-even, where
        # timing noise alone would decide whether anything is drafted.
        engine.cost = AUTO_COST
        engine.fixed_k, engine.k_max = None, 8
    else:
        engine.fixed_k, engine.k_max = int(k), int(k)
    engine.set_proposer(proposer() if callable(proposer) else DrafterRows(lambda: proposer))
    engine.lookup = None  # every step is this drafter's: no lookup guess proposed alone in its place


def assert_metrics_consistent(m: dict[str, Any], max_tokens: int) -> None:
    assert m["output_tokens"] == max_tokens
    assert 0 <= m["accepted_tokens"] <= m["draft_tokens"]
    # Prefill is one step emitting one token; every other step emits accepted + 1.
    assert m["steps"] + m["accepted_tokens"] == max_tokens
    assert m["mean_accepted_length"] == pytest.approx(max_tokens / m["steps"])


@dataclass
class Env:
    plain: LLM
    spec: LLM
    same: Callable[[], DraftModelRows]
    random: Callable[[], DraftModelRows]
    refs: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.plain.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def reference(self, prompt: str | list[int]) -> list[int]:
        ids = tuple(self.prompt_ids(prompt))
        if ids not in self.refs:
            self.refs[ids] = self.plain.generate([list(ids)], greedy())[0].token_ids
        return self.refs[ids]

    @property
    def vocab_size(self) -> int:
        return self.plain.target.config.vocab_size


# ---- tiny random models ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest) -> Iterator[Env]:
    path: Path = request.getfixturevalue("tiny_llama_dir" if request.param == "llama" else "tiny_qwen_dir")
    other: Path = request.getfixturevalue("tiny_llama_other_dir")  # same tokenizer, other weights
    plain = LLM(str(path), dtype="fp32", device="cpu")
    spec = LLM(str(path), dtype="fp32", device="cpu", speculative_config={
        "method": "draft", "model": str(path), "num_speculative_tokens": "auto", "draft_dtype": "fp32"})
    assert isinstance(spec.new_proposer(), DraftModelRows)
    other_model = load_model(other, "fp32", "cpu").model
    env = Env(plain, spec, spec.new_proposer, lambda: DraftModelRows(other_model, spec.max_model_len))
    for p in TINY_PROMPTS:
        env.reference(p)
    yield env


@pytest.mark.parametrize("k", KS_AUTO)
def test_tiny_same_model_draft_accepts_everything(tiny: Env, k: int | str) -> None:
    use(tiny.spec, tiny.same, k)
    outs = tiny.spec.generate(TINY_PROMPTS, greedy())
    for prompt, out in zip(TINY_PROMPTS, outs, strict=True):
        assert out.token_ids == tiny.reference(prompt)
        m = out.metrics
        assert_metrics_consistent(m, MAX_TOKENS)
        if k == "auto":
            assert m["draft_tokens"] > 0 and m["acceptance_rate"] == 1.0
        else:
            assert m["acceptance_rate"] == 1.0
            assert m["acceptance_by_position"] == [1.0] * int(k)
            # Each step emits k + 1 tokens (the last one fewer, capped by max_tokens).
            assert m["steps"] == 1 + math.ceil((MAX_TOKENS - 1) / (int(k) + 1))


@pytest.mark.parametrize("k", KS_AUTO)
def test_tiny_random_draft_accepts_almost_nothing(tiny: Env, k: int | str) -> None:
    use(tiny.spec, tiny.random, k)
    outs = tiny.spec.generate(TINY_PROMPTS, greedy())
    drafted = accepted = 0
    for prompt, out in zip(TINY_PROMPTS, outs, strict=True):
        assert out.token_ids == tiny.reference(prompt)
        assert_metrics_consistent(out.metrics, MAX_TOKENS)
        drafted += out.metrics["draft_tokens"]
        accepted += out.metrics["accepted_tokens"]
    assert drafted > 0
    assert accepted / drafted <= 0.15


@pytest.mark.parametrize("k", KS_AUTO)
def test_tiny_ngram(tiny: Env, k: int | str) -> None:
    use(tiny.spec, lambda: NgramRows(1, 3), k)
    prompts = [*TINY_PROMPTS, NGRAM_EXTRA_IDS]
    outs = tiny.spec.generate(prompts, greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == tiny.reference(prompt)
        assert_metrics_consistent(out.metrics, MAX_TOKENS)
    assert sum(o.metrics["draft_tokens"] for o in outs) > 0


def _oracle_cases() -> list[tuple[int, int | None]]:
    return [(k, j) for k in KS for j in [*range(k), None]]


@pytest.mark.parametrize(("k", "j"), _oracle_cases(), ids=lambda v: "full" if v is None else str(v))
def test_tiny_oracle_partial_acceptance(tiny: Env, k: int, j: int | None) -> None:
    oracle = OracleProposer(tiny.refs, tiny.vocab_size, corrupt_at=j)
    use(tiny.spec, oracle, k)
    prompt = TINY_PROMPTS[0]
    out = tiny.spec.generate(prompt, greedy())[0]
    assert out.token_ids == tiny.reference(prompt)
    m = out.metrics
    assert_metrics_consistent(m, MAX_TOKENS)
    expected = oracle.expected_accepted()
    assert len(oracle.draft_lens) >= 2  # several verify steps
    assert oracle.verified == expected[: len(oracle.verified)]
    # Prefill, one step per draft, and at most one plain step at the end (k capped to 0 by max_tokens).
    assert m["steps"] - 1 - len(oracle.draft_lens) in (0, 1)
    assert m["draft_tokens"] == sum(oracle.draft_lens)
    assert m["accepted_tokens"] == sum(expected)
    by_pos = m["acceptance_by_position"]
    assert len(by_pos) == k
    if j is None:
        assert m["acceptance_rate"] == 1.0
    else:
        assert by_pos[:j] == [1.0] * j
        assert by_pos[j] == 0.0


@pytest.mark.parametrize("j", [0, 2, None])
def test_tiny_oracle_auto_k(tiny: Env, j: int | None) -> None:
    oracle = OracleProposer(tiny.refs, tiny.vocab_size, corrupt_at=j)
    use(tiny.spec, oracle, "auto")
    for prompt in TINY_PROMPTS:
        out = tiny.spec.generate(prompt, greedy())[0]
        assert out.token_ids == tiny.reference(prompt)
        assert_metrics_consistent(out.metrics, MAX_TOKENS)
        assert out.metrics["accepted_tokens"] == sum(oracle.expected_accepted())
        if j is None:
            assert out.metrics["mean_accepted_length"] > 3


def test_tiny_public_api_random_draft_and_ngram(tiny_llama_dir: Path, tiny_llama_other_dir: Path) -> None:
    """The same checks through speculative_config alone (no swapping)."""
    plain = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu")
    refs = [o.token_ids for o in plain.generate(TINY_PROMPTS, greedy())]
    for cfg in (
        {"method": "draft", "model": str(tiny_llama_other_dir), "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    ):
        spec = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=cfg)
        outs = spec.generate(TINY_PROMPTS, greedy())
        assert [o.token_ids for o in outs] == refs
        for o in outs:
            assert_metrics_consistent(o.metrics, MAX_TOKENS)
            assert o.metrics["draft_tokens"] > 0


# ---- SmolLM2-135M (real weights, fp32) ---------------------------------------------------------

SMOL = "smollm2-135m-instruct"
SMOL_TOKENS = 48
SMOL_PROMPTS = [
    "def fibonacci(n):",
    "Here is a list of the planets of the solar system: Mercury, Venus, Earth,",
]


def random_same_vocab_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A small random decoder with the real model's vocabulary: a useless but cheap drafter."""
    small = ModelConfig(
        arch=cfg.arch, vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True, attention_bias=False,
    )
    torch.manual_seed(seed)
    return Transformer(small).eval()


@pytest.fixture(scope="module")
def smol() -> Iterator[Env]:
    plain = LLM(SMOL, dtype="fp32", device="cpu", max_model_len=256)
    # n-gram LLM (no second copy of the weights); the draft-model drafters share the target's weights.
    spec = LLM(SMOL, dtype="fp32", device="cpu", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": "auto"})
    rand_model = random_same_vocab_model(spec.target.config)
    env = Env(plain, spec, lambda: DraftModelRows(spec.target.model, spec.max_model_len),
              lambda: DraftModelRows(rand_model, spec.max_model_len))
    outs = plain.generate(SMOL_PROMPTS, greedy(SMOL_TOKENS))
    for p, o in zip(SMOL_PROMPTS, outs, strict=True):
        env.refs[tuple(env.prompt_ids(p))] = o.token_ids
    yield env


def _smol_check(env: Env, prompt: str, expected_steps: int | None = None) -> dict[str, Any]:
    out = env.spec.generate(prompt, greedy(SMOL_TOKENS))[0]
    assert out.token_ids == env.reference(prompt)
    assert out.text == env.plain.tokenizer.decode(out.token_ids)
    assert_metrics_consistent(out.metrics, SMOL_TOKENS)
    if expected_steps is not None:
        assert out.metrics["steps"] == expected_steps
    return out.metrics


@pytest.mark.real
@pytest.mark.parametrize(("prompt_idx", "k"), [(0, 3), (1, 8)])
def test_smol_same_model_draft(smol: Env, prompt_idx: int, k: int) -> None:
    use(smol.spec, smol.same, k)
    m = _smol_check(smol, SMOL_PROMPTS[prompt_idx], 1 + math.ceil((SMOL_TOKENS - 1) / (k + 1)))
    assert m["acceptance_rate"] == 1.0


@pytest.mark.real
def test_smol_random_draft(smol: Env) -> None:
    use(smol.spec, smol.random, 3)
    m = _smol_check(smol, SMOL_PROMPTS[1])
    assert m["draft_tokens"] > 0 and m["acceptance_rate"] <= 0.1


@pytest.mark.real
@pytest.mark.parametrize(("prompt_idx", "k"), [(0, 4), (1, "auto")])
def test_smol_ngram(smol: Env, prompt_idx: int, k: int | str) -> None:
    use(smol.spec, lambda: NgramRows(1, 3), k)
    _smol_check(smol, SMOL_PROMPTS[prompt_idx])


@pytest.mark.real
@pytest.mark.parametrize(("prompt_idx", "k", "j"), [(0, 4, 1), (1, 6, 4), (0, 8, None)])
def test_smol_oracle(smol: Env, prompt_idx: int, k: int, j: int | None) -> None:
    oracle = OracleProposer(smol.refs, smol.vocab_size, corrupt_at=j)
    use(smol.spec, oracle, k)
    m = _smol_check(smol, SMOL_PROMPTS[prompt_idx])
    assert m["steps"] - 1 - len(oracle.draft_lens) in (0, 1)
    assert m["accepted_tokens"] == sum(oracle.expected_accepted())
