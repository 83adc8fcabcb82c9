"""`LLM.generate`'s batch rows: measured when first needed, refused before they would run out of memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine import validation
from specdecode.engine.validation import InsufficientMemoryError

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\n"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_start_up_measures_one_row_and_batches_when_first_run(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram"}, max_model_len=256)
    assert llm.measurement is not None and llm.measurement.rows == 1
    assert {rows for rows, _ in llm.measurement.medians} == {1}
    single = llm.generate(PROMPTS[0], PARAMS)[0].token_ids
    assert llm.measurement.rows == 1  # a lone prompt needs no batch shapes
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.measurement.rows == 3 and {rows for rows, _ in llm.measurement.medians} >= {1, 3}
    assert llm.engine.cost is llm.cost and llm.cost.target_forward_seconds(12) > 0
    assert outs[0].token_ids == single
    assert llm.batch_engine(max_num_seqs=4) is not None and llm.measurement.rows == 4


def test_generate_refuses_rows_that_do_not_fit(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", max_model_len=256)
    ref = [o.token_ids for o in llm.generate(PROMPTS[:1], PARAMS)]  # one row allocated
    monkeypatch.setattr(validation, "available_bytes", lambda device: 1 << 10)  # 1 KiB free from now on
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], PARAMS)] == ref  # the row it has: no new memory
    refused = r"target KV cache \(3 rows x 320 slots\) 0\.00 GiB.*max_num_seqs"
    with pytest.raises(InsufficientMemoryError, match=refused):
        llm.generate(PROMPTS, PARAMS)
    assert not llm.engine.has_work() and llm.engine.cache is not None and llm.engine.cache.batch_size == 1
    monkeypatch.setattr(validation, "available_bytes", lambda device: 1 << 34)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)][:1] == ref


def test_a_server_engine_allocates_every_drafting_row_up_front(tiny_llama_dir: Path, tiny_llama_other_dir: Path,
                                                              tiny_heads: dict[str, Path]) -> None:
    """Admission never allocates: the draft model's and the EAGLE head's cache rows exist from the start."""
    from specdecode.proposers.draft_rows import DraftModelRows
    from specdecode.proposers.eagle_rows import EagleRows

    for spec in ({"method": "draft", "model": str(tiny_llama_other_dir), "num_speculative_tokens": 3},
                 {"method": "eagle", "model": str(tiny_heads["eagle"]), "num_speculative_tokens": 3}):
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec, max_model_len=256)
        engine = llm.batch_engine(max_num_seqs=4)
        proposer = engine.proposer
        assert isinstance(proposer, DraftModelRows | EagleRows)
        assert proposer.cache.cache is not None and proposer.cache.cache.batch_size == 4
        before = proposer.cache.cache
        for p in PROMPTS:
            engine.add(llm.new_sequence(p, PARAMS))
        while engine.has_work():
            engine.step()
        assert proposer.cache.cache is before
