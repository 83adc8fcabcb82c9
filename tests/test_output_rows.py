"""A draft's output matrix cut to a draft vocabulary (`specdecode.model.output_rows`): the ids kept, the logits
of the kept rows unchanged to the bit and -inf elsewhere (dense and GGUF blocks), and speculation through it
still the target's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gguf_native import write_gguf
from tiny_helpers import GREEDY, tiny_prompts

from specdecode import LLM
from specdecode.model import gguf_linear
from specdecode.model.gguf_model import load_native
from specdecode.model.load import load_model
from specdecode.model.output_rows import lowest_ids, restrict_output


def test_lowest_ids_keep_the_added_tokens_and_fill_whole_tiles() -> None:
    ids = lowest_ids(1000, 40, [998, 5, 2000])
    assert ids.tolist() == sorted(set(ids.tolist()))
    assert set(range(40)) | {998} <= set(ids.tolist())
    assert 2000 not in ids.tolist() and len(ids) % 16 == 0
    assert lowest_ids(20, 64, []).tolist() == list(range(20))  # a small vocabulary: every id, no padding past it


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1])[None]
    with torch.inference_mode():
        return model.compute_logits(model(tokens, pos, model.new_cache(1, 16)))


def _check_rows(full: torch.Tensor, cut: torch.Tensor, ids: torch.Tensor) -> None:
    assert cut.shape == full.shape
    assert torch.equal(cut[..., ids], full[..., ids])
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(cut[..., others]).all()


TOKENS = torch.tensor([[1, 5, 9, 42, 7, 3]])


def test_dense_rows_keep_their_logits(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu").model
    full = _logits(model, TOKENS)
    ids = lowest_ids(model.config.vocab_size, 100, [317])
    restrict_output(model, ids)
    _check_rows(full, _logits(model, TOKENS), ids)


@pytest.mark.skipif(not gguf_linear.available(), reason="GGUF kernels need AVX2")
def test_gguf_rows_keep_their_logits(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_qwen_dir, tmp_path / "tiny.gguf")
    model, _ = load_native(path, torch.float32)
    full = _logits(model, TOKENS)
    ids = lowest_ids(model.config.vocab_size, 64, [318, 319])
    restrict_output(model, ids)
    assert isinstance(model.lm_head, gguf_linear.GGUFLinear) and model.lm_head.native
    _check_rows(full, _logits(model, TOKENS), ids)
    with pytest.raises(ValueError, match="tiles of 16"):
        restrict_output(load_native(path, torch.float32)[0], ids[:-1])


def test_a_draft_over_a_draft_vocabulary_gives_the_targets_output(tiny_llama_dir: Path) -> None:
    """The target drafting for itself over its 64 lowest ids (and the added tokens): its guesses within them
    are accepted, the rest cannot be drafted, and the output is plain decoding's."""
    plain = LLM(str(tiny_llama_dir), device="cpu", dtype="fp32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in plain.generate(tiny_prompts(plain), GREEDY)]
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="fp32", max_model_len=256,
              speculative_config={"method": "draft", "model": str(tiny_llama_dir), "draft_vocab_size": 64,
                                  "num_speculative_tokens": 3, "draft_prompt_lookup": False})
    assert llm.draft is not None and llm.draft.model.output_ids is not None
    assert len(llm.draft.model.output_ids) < llm.draft.model.config.vocab_size
    outs = llm.generate(tiny_prompts(llm), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics["accepted_tokens"] for o in outs) > 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "32768"])
def test_a_bad_draft_vocab_size_is_refused(bad: object) -> None:
    from specdecode.config import SpeculativeConfig

    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig.from_any({"method": "draft", "model": "m", "draft_vocab_size": bad})
