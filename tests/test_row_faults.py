"""Fault isolation per request: an error in one row's proposal, grammar or sampling fails that request alone.

One of four rows is poisoned mid-flight (after a few tokens, while the others run): its proposer raises (after
every row's drafting state has moved, as a failure half-way through the batched call would leave it), its
grammar matcher raises, its sampling raises, or the target's logits for it are NaN. That request finishes with
finish_reason "error" and a message; the three others give their solo greedy outputs token for token. Through
the server the failed request gets a 500 body (or an error event then `[DONE]`) and the others their answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine import step_verify
from specdecode.engine.core import Engine
from specdecode.engine.row_faults import propose_rows
from specdecode.engine.sequence import Sequence
from specdecode.proposers.base import Draft, ProposeRow, SequenceView
from specdecode.sampling import draw_uniforms

TEXTS = ["def add(a, b):", "The quick brown fox", "x = [1, 2, 3]\nfor i in x:", "import os\nimport sys\n"]
MAX_TOKENS = 20
POISON = 1
"""The row that fails (its prompt is TEXTS[POISON])."""
AFTER = 3
"""It fails once it has this many output tokens, with the other rows running."""


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and their plain greedy outputs, one request at a time."""
    plain = LLM(str(tiny_llama_dir), dtype="fp32")
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    return prompts, [plain.generate([p], greedy())[0].token_ids for p in prompts]


def run(llm: LLM, engine: Engine, seqs: list[Sequence]) -> None:
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    assert not engine.running and engine.prefilling is None  # the failed row left the batch too


def poisoned(seq: Sequence | SequenceView, prompt: list[int]) -> bool:
    """The poisoned row once it has AFTER output tokens."""
    return seq.token_ids[: seq.prompt_len] == prompt and len(seq.token_ids) - seq.prompt_len >= AFTER


def check(seqs: list[Sequence], ref: list[list[int]], what: str, after: int = AFTER) -> None:
    """The poisoned request failed mid-flight (with at least `after` tokens) with a message naming `what`; every
    other one gave its solo output."""
    bad = seqs[POISON]
    assert bad.finish_reason == "error" and bad.error is not None and what in bad.error, bad.error
    assert after <= bad.num_output < MAX_TOKENS
    out = bad.to_output()
    assert out.finish_reason == "error" and out.error == bad.error
    for i, s in enumerate(seqs):
        if i != POISON:
            assert s.finish_reason == "length" and s.error is None
            assert s.output_ids == ref[i], i


# ---- the proposal --------------------------------------------------------------------------------------------


def methods(tiny: Path, heads: dict[str, Path] | None = None) -> dict[str, dict[str, Any]]:
    eagle = str(heads["eagle"]) if heads else ""
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft-chain": {"method": "draft", "model": str(tiny), "num_speculative_tokens": 4},
        "draft-tree": {"method": "draft", "model": str(tiny), "num_speculative_tokens": 3, "draft_tree_width": 2},
        "eagle-tree": {"method": "eagle", "model": eagle, "num_speculative_tokens": 4,
                       "draft_tree_width": 0},
    }


@pytest.mark.parametrize("method", ["ngram", "draft-chain", "draft-tree", "eagle-tree"])
def test_a_raising_proposer_fails_its_row_alone(method: str, tiny_llama_dir: Path, tiny_heads: dict[str, Path],
                                                reference) -> None:  # noqa: ANN001
    prompts, ref = reference
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=methods(tiny_llama_dir, tiny_heads)[method])
    engine = llm.batch_engine(max_num_seqs=4)
    proposer: Any = engine.proposer
    real = proposer.propose
    batches: list[int] = []

    def propose(asks: list[ProposeRow]) -> list[Draft]:
        drafts = real(asks)  # every row's drafting state moves first: the failed call leaves them half-updated
        if any(poisoned(a.seq, prompts[POISON]) for a in asks):
            batches.append(len(asks))
            raise RuntimeError("injected proposer failure")
        return drafts

    proposer.propose = propose
    seqs = [llm.new_sequence(p, greedy()) for p in prompts]
    run(llm, engine, seqs)
    check(seqs, ref, "the proposal")
    assert batches[0] == 4 and 1 in batches  # it failed in the batch, then alone
    if hasattr(proposer, "rows"):
        assert not proposer.rows  # every row's drafting state was released


def test_a_bad_draft_fails_its_row_alone(tiny_llama_dir: Path, reference) -> None:  # noqa: ANN001
    """A draft the forward cannot run (a token id past the vocabulary) fails its row, not the batch's forward."""
    prompts, ref = reference
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=methods(tiny_llama_dir)["ngram"])
    engine = llm.batch_engine(max_num_seqs=4)
    proposer: Any = engine.proposer
    real = proposer.propose

    def propose(asks: list[ProposeRow]) -> list[Draft]:
        drafts = real(asks)
        return [Draft([10**6]) if poisoned(a.seq, prompts[POISON]) else d for a, d in zip(asks, drafts, strict=True)]

    proposer.propose = propose
    seqs = [llm.new_sequence(p, greedy()) for p in prompts]
    run(llm, engine, seqs)
    check(seqs, ref, "outside the vocabulary")


class CountingProposer:
    """A free proposer whose drafts draw from each row's generator; the batched call raises when it holds `bad`."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.verified: list[int] = []

    def propose(self, asks: list[ProposeRow]) -> list[Draft]:
        drafts = [Draft([int(draw_uniforms(1, a.seq.generator)[0] * 100)]) for a in asks]
        if any(a.key == self.bad for a in asks):
            raise RuntimeError("injected")
        return drafts

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        self.verified.append(key)


def test_the_solo_retries_start_where_the_rows_stood(tiny_llama_dir: Path) -> None:
    """After a failed batched call each row's generator is put back and its drafting state reset, so its solo
    draft is the one it would have drafted alone."""
    llm = LLM(str(tiny_llama_dir), dtype="fp32")
    params = SamplingParams(temperature=0.8, seed=7)
    seqs = [llm.new_sequence([5, 6, 7], params) for _ in range(3)]
    asks = [ProposeRow(key, s.view(), 1, 1) for key, s in enumerate(seqs)]
    alone = [CountingProposer(bad=-1).propose([ProposeRow(0, llm.new_sequence([5, 6, 7], params).view(), 1, 1)])[0]]
    proposer = CountingProposer(bad=1)
    drafts = propose_rows(proposer, asks, dict(enumerate(seqs)), 320)  # type: ignore[arg-type]
    assert drafts[0].tokens == drafts[2].tokens == alone[0].tokens and drafts[1].tokens == []
    assert proposer.verified == [0, 1, 2]  # each row reset before its retry
    assert [s.finish_reason for s in seqs] == [None, "error", None] and "injected" in (seqs[1].error or "")


# ---- the grammar ---------------------------------------------------------------------------------------------


class FailingGrammar:
    """A `TokenMatcher` that allows every token and raises in `where` once `AFTER` tokens are committed."""

    def __init__(self, vocab: int, where: str) -> None:
        self.vocab, self.where, self.path = vocab, where, 0

    def _maybe_fail(self, where: str) -> None:
        if where == self.where and self.path >= AFTER:
            raise RuntimeError("injected grammar failure")

    def allowed(self) -> torch.Tensor:
        self._maybe_fail("allowed")
        return torch.ones(self.vocab, dtype=torch.bool)

    def consume(self, token: int) -> bool:
        self._maybe_fail("consume")
        self.path += 1
        return True

    def rollback(self, n: int) -> None:
        self.path -= n

    def is_stopped(self) -> bool:
        return False

    def forced(self) -> list[int]:
        self._maybe_fail("forced")
        return []


@pytest.mark.parametrize(("method", "where"), [(None, "allowed"), ("ngram", "consume"), ("ngram", "forced"),
                                               ("draft-chain", "allowed")])
def test_a_raising_grammar_fails_its_row_alone(method: str | None, where: str, tiny_llama_dir: Path,
                                               reference) -> None:  # noqa: ANN001
    prompts, ref = reference
    spec = None if method is None else methods(tiny_llama_dir)[method]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    engine = llm.batch_engine(max_num_seqs=4)
    seqs = [llm.new_sequence(p, greedy()) for p in prompts]
    seqs[POISON].matcher = FailingGrammar(llm.target.config.vocab_size, where)
    run(llm, engine, seqs)
    # The draft model walks the grammar along its draft: there the proposal fails, as soon as the committed and
    # drafted tokens reach AFTER.
    check(seqs, ref, "injected grammar failure", after=1 if method == "draft-chain" else AFTER)


# ---- sampling ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_their_row_alone(temperature: float, tiny_llama_dir: Path, reference) -> None:  # noqa: ANN001
    """The target's logits turn NaN for one row (greedy: the argmax would be the NaN; sampled: an id past the
    vocabulary): that row fails with a message that says so."""
    prompts, ref = reference
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=methods(tiny_llama_dir)["ngram"])
    engine = llm.batch_engine(max_num_seqs=4)
    forward = engine._target_forward

    def nan_forward(plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits = forward(plan)
        for i, r in enumerate(engine.running):
            if poisoned(r.seq, prompts[POISON]):
                with torch.inference_mode():
                    logits[plan.offsets[i] : plan.offsets[i + 1]] = float("nan")
        return hidden, logits

    engine._target_forward = nan_forward  # type: ignore[method-assign]
    seqs = [llm.new_sequence(p, greedy()) for p in prompts]
    seqs[POISON] = llm.new_sequence(prompts[POISON], SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature,
                                                                    seed=3, ignore_eos=True))
    run(llm, engine, seqs)
    check(seqs, ref, "NaN")


def test_raising_sampling_fails_its_row_alone(tiny_llama_dir: Path, reference, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:  # noqa: ANN001
    """The sampling processors raise for one request: at its first token (it never joins the running rows) or
    mid-flight; the others run on."""
    prompts, ref = reference
    llm = LLM(str(tiny_llama_dir), dtype="fp32")
    real = step_verify.logits_to_probs

    def processors(logits: torch.Tensor, params: SamplingParams, *args: Any) -> torch.Tensor:
        if params.seed == 13:
            raise RuntimeError("injected sampling failure")
        return real(logits, params, *args)

    monkeypatch.setattr(step_verify, "logits_to_probs", processors)
    engine = llm.batch_engine(max_num_seqs=4)
    seqs = [llm.new_sequence(p, greedy()) for p in prompts]
    seqs[POISON] = llm.new_sequence(prompts[POISON], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=13))
    run(llm, engine, seqs)
    assert seqs[POISON].finish_reason == "error" and "its first token" in (seqs[POISON].error or "")
    assert all(s.output_ids == ref[i] for i, s in enumerate(seqs) if i != POISON)

    verify_row = step_verify.verify_row

    def failing_row(seq: Sequence, *args: Any) -> Any:
        if poisoned(seq, prompts[POISON]):
            raise RuntimeError("injected sampling failure")
        return verify_row(seq, *args)

    monkeypatch.setattr(step_verify, "verify_row", failing_row)
    seqs = [llm.new_sequence(p, greedy()) for p in prompts]
    run(llm, engine, seqs)
    check(seqs, ref, "sampling")


# ---- through the server --------------------------------------------------------------------------------------


def test_the_server_fails_that_request_alone(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose sampling raises mid-flight gets a 500 (streamed: an error event, then [DONE]); the
    requests running beside it get their solo answers."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx
    from server_helpers import API_KEY, LiveServer, sse_events

    from specdecode.server.app import build_app

    llm = LLM(str(tiny_llama_dir), dtype="fp32", max_model_len=512)
    engine = llm.batch_engine(max_num_seqs=5, max_waiting=8)
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.01)  # the requests overlap
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    verify_row = step_verify.verify_row

    def failing_row(seq: Sequence, *args: Any) -> Any:
        if seq.params.seed == 666 and seq.num_output >= 2 and len(engine.running) >= 4:
            raise RuntimeError("injected sampling failure")
        return verify_row(seq, *args)

    monkeypatch.setattr(step_verify, "verify_row", failing_row)
    server = LiveServer(build_app(llm, engine, served_model_name="tiny", api_key=API_KEY)).start()
    try:
        healthy = [{"model": "tiny", "prompt": t, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
                   for t in TEXTS[:3]]
        solo = [server.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in healthy]
        bad = {"model": "tiny", "prompt": TEXTS[3], "max_tokens": 200, "temperature": 0.5, "seed": 666,
               "ignore_eos": True}
        results: dict[str, Any] = {}

        def post(name: str, body: dict[str, Any]) -> Callable[[], None]:
            def go() -> None:
                if body.get("stream"):
                    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                                      headers=server.headers, timeout=60) as r:
                        results[name] = (r.status_code, sse_events(r.iter_lines()))
                else:
                    results[name] = server.post("/v1/completions", json=body)
            return go

        jobs = {**{f"ok{i}": b for i, b in enumerate(healthy)}, "bad": bad, "bad-stream": {**bad, "stream": True}}
        threads = [threading.Thread(target=post(name, body)) for name, body in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        r = results["bad"]
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert "sampling" in error["message"] and "injected" in error["message"] and error["code"] == "engine_error"
        status, events = results["bad-stream"]
        assert status == 200 and events[-1] == "[DONE]" and "injected" in events[-2]["error"]["message"]
        assert [results[f"ok{i}"].json()["choices"][0]["text"] for i in range(3)] == solo
        m = server.metrics()
        assert m['specdecode_requests_finished_total{finish_reason="error"}'] == 2
        assert m['specdecode_request_errors_total{code="500"}'] == 2
        assert not engine.running and not engine.waiting and engine.prefilling is None
    finally:
        server.stop()
