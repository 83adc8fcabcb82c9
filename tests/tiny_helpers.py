"""Prompts and greedy parameters shared by the tests that compare speculative output with plain output
on the tiny random models (the plain reference itself is the `plain_tiny` fixture in conftest)."""

from __future__ import annotations

from specdecode import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def tiny_prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode("def add(a, b):"), llm.tokenizer.encode("The quick brown fox")]
