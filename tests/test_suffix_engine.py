"""Suffix decoding through `LLM`: greedy output equals plain decoding for `suffix` alone and as the lookup of
EAGLE and the draft model; earlier answers are drafted from in "global" scope, per tenant in "key" scope, never
in "request" scope."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_helpers import GREEDY, tiny_prompts

from specdecode import LLM, SamplingParams


def _accepted(outs: list) -> float:  # noqa: ANN001
    return sum(o.metrics["accepted_tokens"] for o in outs)


@pytest.mark.parametrize("k", [4, "auto"])
def test_suffix_greedy_equals_plain_and_drafts_from_earlier_answers(plain_tiny, tiny_llama_dir: Path,
                                                                     k: int | str) -> None:
    base, ref = plain_tiny
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "suffix", "num_speculative_tokens": k})
    first = llm.generate(tiny_prompts(base), GREEDY)
    assert [o.token_ids for o in first] == ref
    again = llm.generate(tiny_prompts(base), GREEDY)  # the store holds the first answers
    assert [o.token_ids for o in again] == ref
    assert _accepted(again) > _accepted(first)
    if k == 4:
        assert all(o.metrics["mean_accepted_length"] > 3.0 for o in again)
    assert llm.lookup is not None and llm.lookup.store is not None and llm.lookup.store.tokens > 0


def test_request_scope_drafts_from_the_request_alone(plain_tiny, tiny_llama_dir: Path) -> None:
    base, ref = plain_tiny
    llm = LLM(str(tiny_llama_dir), dtype="fp32",
              speculative_config={"method": "suffix", "num_speculative_tokens": 4, "suffix_scope": "request"})
    first = llm.generate(tiny_prompts(base), GREEDY)
    again = llm.generate(tiny_prompts(base), GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == ref
    assert _accepted(again) == _accepted(first)
    assert llm.lookup is not None and llm.lookup.store is not None and llm.lookup.store.tokens == 0


def test_key_scope_drafts_from_the_same_tenants_answers_only(plain_tiny, tiny_llama_dir: Path) -> None:
    base, ref = plain_tiny
    llm = LLM(str(tiny_llama_dir), dtype="fp32",
              speculative_config={"method": "suffix", "num_speculative_tokens": 4, "suffix_scope": "key"})
    prompts = tiny_prompts(base)

    def run(salt: str) -> list:  # noqa: ANN202
        return llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], GREEDY)

    alice = run("alice")
    bob = run("bob")  # alice's answers are not bob's to draft from
    alice_again = run("alice")
    assert [o.token_ids for o in alice] == [o.token_ids for o in bob] == [o.token_ids for o in alice_again] == ref
    assert _accepted(bob) == _accepted(alice)
    assert _accepted(alice_again) > _accepted(alice)


@pytest.mark.parametrize("method", ["eagle", "draft"])
def test_drafters_with_the_suffix_lookup_keep_greedy_output(plain_tiny, tiny_llama_dir: Path,
                                                            tiny_llama_other_dir: Path, tiny_heads: dict[str, Path],
                                                            method: str) -> None:
    base, ref = plain_tiny
    model = str(tiny_heads["eagle"]) if method == "eagle" else str(tiny_llama_other_dir)
    for k in (3, "auto"):
        llm = LLM(str(tiny_llama_dir), dtype="fp32",
                  speculative_config={"method": method, "model": model, "num_speculative_tokens": k})
        first = llm.generate(tiny_prompts(base), GREEDY)
        again = llm.generate(tiny_prompts(base), GREEDY)  # earlier answers ride in the lookup
        assert [o.token_ids for o in first] == [o.token_ids for o in again] == ref
        if k == 3 and method == "eagle":  # the earlier answer is grafted onto the head's random tree
            assert _accepted(again) > _accepted(first)


def test_a_seeded_sampled_request_does_not_depend_on_earlier_answers(tiny_llama_dir: Path) -> None:
    """Sampling drafts from the request's own text only: earlier answers would change its drafts, and with them
    the random numbers verification draws."""
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    prompts = tiny_prompts(llm)
    a = llm.generate(prompts, params)
    llm.generate(prompts, GREEDY)
    b = llm.generate(prompts, params)
    assert llm.lookup is not None and llm.lookup.store is not None and llm.lookup.store.tokens > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_suffix_flags_tune_a_speculative_config_and_bad_values_are_refused() -> None:
    from specdecode.cli import build_parser
    from specdecode.cli_args import speculative_config_from_args
    from specdecode.config import SpeculativeConfig

    args = build_parser().parse_args(["serve", "--method", "suffix", "--suffix-scope", "key",
                                      "--suffix-cache-tokens", "1000"])
    cfg = SpeculativeConfig.from_any(speculative_config_from_args(args))
    assert cfg is not None and (cfg.method, cfg.suffix_scope, cfg.suffix_cache_tokens) == ("suffix", "key", 1000)
    assert cfg.k_max == 16 and SpeculativeConfig("ngram").k_max == 8
    alone = build_parser().parse_args(["serve", "--suffix-scope", "key"])
    assert speculative_config_from_args(alone) is None  # no speculation asked for: none made
    with pytest.raises(ValueError, match="suffix_scope"):
        SpeculativeConfig("suffix", suffix_scope="tenant")
    with pytest.raises(ValueError, match="suffix_cache_tokens"):
        SpeculativeConfig("suffix", suffix_cache_tokens=-1)
