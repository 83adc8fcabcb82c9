"""Draft vocabularies: a draft whose tokenizer is the target's but whose embeddings/output rows are padded
differently (Qwen2.5: 151,936 vs 152,064 rows) is accepted and never proposes a padding row; a draft with
another tokenizer drafts across vocabularies."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from conftest import _save_tokenizer
from tiny_helpers import GREEDY, copy_with_vocab_rows, record_rows, tiny_prompts

from specdecode import LLM, SamplingParams
from specdecode.proposers.draft_rows import DraftModelRows, draft_logits


def padded_copy(src: Path, dst: Path, extra: int) -> Path:
    """src with `extra` padding rows whose output logits would win every argmax if they were ever proposed."""
    return copy_with_vocab_rows(src, dst, extra, head_fill=50.0)


def draft(model: Path, k: int = 4, **kw: object) -> dict[str, object]:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": k, "draft_dtype": "fp32", **kw}


def test_padded_draft_is_accepted_and_lossless(plain_tiny, tiny_llama_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    _, want = plain_tiny
    padded = padded_copy(tiny_llama_dir, tmp_path / "padded", 64)
    for spec in (draft(padded), draft(padded, draft_tree_width=3)):
        llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=spec)
        assert isinstance(llm.engine.proposer, DraftModelRows)
        outs = llm.generate(tiny_prompts(llm), GREEDY)
        assert [o.token_ids for o in outs] == want
        # The draft is the target's own weights: with padding rows never proposed, nearly every token is taken.
        assert all(o.metrics["acceptance_by_position"][0] > 0.9 for o in outs), [o.metrics for o in outs]
        assert max(t for o in outs for t in o.token_ids) < 320


def test_padded_target_with_unpadded_draft_is_lossless(tiny_llama_dir: Path, tmp_path: Path) -> None:
    target = padded_copy(tiny_llama_dir, tmp_path / "target", 128)  # the 152,064 side
    plain = LLM(str(target), dtype="fp32", device="cpu")
    prompts = tiny_prompts(plain)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    # Its padding rows score high here, so it even emits padding ids, which the draft has no rows for.
    assert any(t >= 320 for ids in want for t in ids)
    spec = LLM(str(target), dtype="fp32", device="cpu", speculative_config=draft(tiny_llama_dir))
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want


def test_padded_draft_never_proposes_padding_rows(tiny_llama_dir: Path, tmp_path: Path) -> None:
    padded = padded_copy(tiny_llama_dir, tmp_path / "padded", 64)
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=draft(padded))
    proposer = llm.engine.proposer
    assert isinstance(proposer, DraftModelRows) and proposer.vocab == (320, 320)
    logits = draft_logits(proposer.model, proposer.vocab, torch.zeros(2, 64))
    assert logits.shape == (2, 320)  # laid out over the target's rows; the padding rows are gone
    raw = proposer.model.compute_logits(torch.ones(1, 64))
    assert raw.shape[-1] == 384 and int(raw.argmax()) >= 320  # unmasked, a padding row would win


def test_draft_with_another_tokenizer_drafts_across_vocabularies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Another tokenizer is no longer refused: the draft's text crosses over (tests/test_cross_vocab.py)."""
    from specdecode.proposers.cross_vocab_rows import CrossVocabDraftRows

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    _save_tokenizer(other, 300)
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=draft(other))
    assert isinstance(llm.engine.proposer, CrossVocabDraftRows)


def test_padded_draft_when_sampling(tiny_llama_dir: Path, tmp_path: Path) -> None:
    padded = padded_copy(tiny_llama_dir, tmp_path / "padded", 64)
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=draft(padded))
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    outs = llm.generate(tiny_prompts(llm), params)
    assert all(len(o.token_ids) == 24 and max(o.token_ids) < 320 for o in outs)
    assert outs[0].metrics["accepted_tokens"] > 0


def test_a_long_prompt_costs_the_draft_a_window_only(tiny_llama_dir: Path) -> None:
    """The draft reads a long prompt's last `window` tokens only (its catch-up is bounded, its K/V slot j holds
    token skipped + j); output identical to plain."""
    plain = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu")
    prompt = plain.tokenizer.encode("def add(a, b):\n    return a + b\n" * 6)
    assert len(prompt) > 40
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = plain.generate([prompt], params)[0].token_ids
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=draft(tiny_llama_dir))
    proposer = llm.engine.proposer
    assert isinstance(proposer, DraftModelRows)
    proposer.window = 16
    seen = record_rows(llm)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == want and out.metrics["draft_tokens"] > 0
    row = seen[0]
    assert row.skipped >= len(prompt) - 16 and row.num_cached <= 16 + len(want)  # never the whole prompt
