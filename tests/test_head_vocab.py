"""Draft vocabularies: frequency choice plus the tokenizer's lowest ids, and widening a saved head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_helpers import GREEDY, tiny_prompts

from specdecode import LLM
from specdecode.heads.persist import load_head, new_head, save_head
from specdecode.heads.vocab import choose_draft_vocab, main, widen_draft_vocab, widen_head
from specdecode.model.load import load_model


def test_widen_adds_the_lowest_ids_sorted_without_repeats() -> None:
    d2t = torch.tensor([2, 7, 40, 90])
    assert widen_draft_vocab(d2t, 5, 100).tolist() == [0, 1, 2, 3, 4, 7, 40, 90]
    assert widen_draft_vocab(d2t, 0, 100).tolist() == [2, 7, 40, 90]
    assert widen_draft_vocab(d2t, 10**6, 100).tolist() == list(range(100))  # capped at the target's vocabulary
    with pytest.raises(ValueError, match="first_ids"):
        widen_draft_vocab(d2t, -1, 100)


def test_choose_keeps_the_most_frequent_plus_always_plus_first() -> None:
    target_next = torch.tensor([50, 50, 50, 60, 60, 70])
    assert choose_draft_vocab(target_next, 100, 2, always=[99]).tolist() == [50, 99]  # EOS-like id beats 60
    assert choose_draft_vocab(target_next, 100, 3, always=[99], first_ids=3).tolist() == [0, 1, 2, 50, 60, 99]


def test_widened_head_keeps_its_weights_and_greedy_output(tiny_llama_dir: Path, tmp_path: Path, plain_tiny) -> None:
    """Only d2t and the config change; the new rows are the target's own, and output stays plain decoding's."""
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    vocab = target.config.vocab_size
    head = new_head(target, "eagle", torch.arange(vocab // 2, vocab), seed=4)  # the upper half only
    save_head(head, tmp_path / "narrow")
    assert main([str(tmp_path / "narrow"), str(tmp_path / "wide"), "--first-ids", "10"]) == 0
    wide = load_head(tmp_path / "wide", target, kind="eagle")
    assert wide.d2t.tolist() == list(range(10)) + list(range(vocab // 2, vocab))
    assert wide.config.draft_vocab_size == len(wide.d2t)
    assert torch.equal(wide.lm_head.weight, target.lm_head.weight[wide.d2t])
    for name, value in head.saved_state().items():
        if name != "d2t":
            assert torch.equal(wide.saved_state()[name], value), name
    record = json.loads((tmp_path / "wide" / "training.json").read_text())["widened_draft_vocab"]
    assert record == {"first_ids": 10, "from": vocab - vocab // 2, "to": len(wide.d2t)}
    assert widen_head(tmp_path / "wide", tmp_path / "wide", 10) == len(wide.d2t)  # idempotent, in place

    base, ref = plain_tiny
    spec = {"method": "eagle", "model": str(tmp_path / "wide"), "num_speculative_tokens": 3}
    outs = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec).generate(tiny_prompts(base), GREEDY)
    assert [o.token_ids for o in outs] == ref
