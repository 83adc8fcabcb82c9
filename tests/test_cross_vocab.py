"""Drafting across tokenizers: the bytes of every id, the draft's text kept in step with the target's (and rolled
back to the last agreed boundary), continuations mapped back to the target's ids, and the engine's output
unchanged: greedy identical to plain, sampling exact (tests/test_engine_lossless.py holds the chi-square)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_hf_dir
from transformers import AutoTokenizer
from vocab_helpers import permuted_copy, save_ascii_tokenizer

from specdecode import LLM, SamplingParams
from specdecode.engine.validation import IncompatibleDraftError
from specdecode.model.token_bytes import complete_utf8, encode_with_ends, token_bytes
from specdecode.proposers.cross_vocab_rows import CrossVocabDraftRows
from specdecode.proposers.text_bridge import DraftText, TextBridge

EDGE_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "  leading spaces,\ttabs and  double  spaces ",
    "Héllo wörld: € 你好 🙂 naïve café",
    "<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n",
    "x" * 40 + " " + "ü" * 7 + "\n\n\nend",
]


@pytest.fixture(scope="module")
def sp_dir(tiny_sentencepiece_dir: Path) -> Path:
    return tiny_sentencepiece_dir


@pytest.fixture(scope="module")
def permuted_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return permuted_copy(tiny_llama_dir, tmp_path_factory.mktemp("permuted") / "m")


def _tok(path: Path):  # noqa: ANN202 - a Hugging Face fast tokenizer
    return AutoTokenizer.from_pretrained(str(path))


# ---- the bytes of ids -------------------------------------------------------------------------------------


def test_complete_utf8_stops_before_a_split_character() -> None:
    euro = "€".encode()  # 3 bytes
    assert complete_utf8(b"ab") == 2
    assert complete_utf8(b"a" + euro) == 4
    assert complete_utf8(b"a" + euro[:2]) == 1
    assert complete_utf8(b"a" + euro[:1]) == 1
    assert complete_utf8("🙂".encode()[:3]) == 0
    assert complete_utf8(b"") == 0


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece", "permuted"])
def test_ids_spell_the_text_back(which: str, tiny_llama_dir: Path, sp_dir: Path, permuted_dir: Path) -> None:
    hf = _tok({"byte_level": tiny_llama_dir, "sentencepiece": sp_dir, "permuted": permuted_dir}[which])
    table = token_bytes(hf)
    assert len(table) == len(hf)
    for text in EDGE_TEXTS:
        ids, ends = encode_with_ends(hf, table, text)
        data = text.encode()
        assert ends[-1] == len(data) and ends == sorted(ends)
        spelled = b"".join(table[i] for i in ids)
        # SentencePiece prepends one space to the whole text; everything else is the text's own bytes.
        assert spelled == data or (which == "sentencepiece" and spelled == b" " + data), (text, spelled)


# ---- the draft's text in step with the target's -------------------------------------------------------------


def _bridges(tiny_llama_dir: Path, sp_dir: Path, permuted_dir: Path) -> list[TextBridge]:
    target = _tok(tiny_llama_dir)
    return [TextBridge(target, _tok(sp_dir)), TextBridge(target, _tok(permuted_dir))]


def test_sync_in_steps_equals_one_whole_tokenization(tiny_llama_dir: Path, sp_dir: Path, permuted_dir: Path) -> None:
    rng = random.Random(0)
    for bridge in _bridges(tiny_llama_dir, sp_dir, permuted_dir):
        for text in EDGE_TEXTS:
            # Byte tokens split multi-byte characters across steps, as a model's output can.
            target_ids = [bridge.target_byte_ids[b] for b in text.encode()]
            row, at = DraftText(), 0
            while at < len(target_ids):
                at = min(len(target_ids), at + rng.randint(1, 6))
                before = list(row.ids)
                keep = bridge.sync(row, target_ids[:at], len(row.ids))
                assert row.ids[:keep] == before[:keep]
                whole = text.encode()[:at]
                valid = whole[: complete_utf8(whole)].decode()
                want, _ = encode_with_ends(bridge.draft_hf, bridge.draft_bytes, valid)
                assert row.ids == want, (text, at)
                assert row.pending == whole[len(valid.encode()):]


def test_sync_rolls_back_a_wrong_draft_to_the_agreed_boundary(tiny_llama_dir: Path, sp_dir: Path,
                                                              permuted_dir: Path) -> None:
    for bridge in _bridges(tiny_llama_dir, sp_dir, permuted_dir):
        target = bridge.target_encode
        row = DraftText()
        context = "def add(a, b):\n"
        said = target(context)  # the target's ids only ever grow
        bridge.sync(row, said, 0)
        drafted_from = len(row.ids)
        ids, ends = encode_with_ends(bridge.draft_hf, bridge.draft_bytes, context + "    return a + b")
        for t, end in zip(ids, ends, strict=True):  # the draft feeds its own chain
            if end > len(context):
                row.append(t, bridge.draft_bytes[t])
        # The target keeps "    return a" and goes on with " * b".
        new_text = "def add(a, b):\n    return a * b"
        keep = bridge.sync(row, said + target("    return a * b"), len(row.ids))
        # Kept: the ids before the disagreement (a merge may move the boundary a token into the context, as
        # "\n" + "   " -> "\n   "); the drafted " +" and what follows are gone.
        assert drafted_from - 2 <= keep <= len(row.ids) - 2
        spelled = b"".join(bridge.draft_bytes[i] for i in row.ids[:keep])
        assert new_text.encode().startswith(spelled.lstrip(b" ")) and len(spelled) >= len(context) - 1, spelled
        want, _ = encode_with_ends(bridge.draft_hf, bridge.draft_bytes, new_text)
        assert row.ids == want


def test_to_target_completes_a_split_character_and_refuses_another(tiny_llama_dir: Path, sp_dir: Path) -> None:
    bridge = TextBridge(_tok(tiny_llama_dir), _tok(sp_dir))
    euro = "€".encode()
    got = bridge.to_target(euro[:2], euro + b" add(a")
    assert got[0] == bridge.target_byte_ids[euro[2]]
    assert got[1:] == bridge.target_encode(" add(a")
    assert bridge.to_target(euro[:2], "£ add".encode()) == []
    assert bridge.to_target(b"", b"return " + euro[:1]) == bridge.target_encode("return ")  # split tail left out
    assert bridge.to_target(b"", b"<|im_end|>") == [bridge.target_hf.convert_tokens_to_ids("<|im_end|>")]


# ---- through the engine -------------------------------------------------------------------------------------

PROMPTS = ["def add(a, b):\n", "  The quick brown fox", "Héllo wörld € 你好", "for i in range(10):\n    print("]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _spec(draft: Path, **kw: object) -> dict[str, object]:
    return {"method": "draft", "model": str(draft), "draft_dtype": "fp32", **kw}


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu")
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("which", ["sentencepiece", "permuted"])
@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_is_identical_to_plain(which: str, k: object, plain, tiny_llama_dir: Path, sp_dir: Path,  # noqa: ANN001
                                      permuted_dir: Path) -> None:
    draft = sp_dir if which == "sentencepiece" else permuted_dir
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu",
              speculative_config=_spec(draft, num_speculative_tokens=k))
    assert isinstance(llm.engine.proposer, CrossVocabDraftRows)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain[1]
    if k == 4:
        assert all(o.metrics["draft_tokens"] > 0 for o in outs)


def test_the_target_behind_another_vocabulary_drafts_what_it_emits(tmp_path: Path) -> None:
    """A target over ASCII characters (one tokenization per text) and its own weights behind a permuted
    vocabulary: the draft reads the same text, computes the same function and drafts the target's greedy
    continuation, so nearly every draft token is taken."""
    target = make_tiny_hf_dir(tmp_path / "ascii", save_tokenizer=save_ascii_tokenizer)
    prompts = ["def add(a, b):\n", "  The quick brown fox", "for i in range(10):\n    print("]
    want = [o.token_ids for o in LLM(str(target), dtype="fp32", device="cpu").generate(prompts, GREEDY)]
    llm = LLM(str(target), dtype="fp32", device="cpu",
              speculative_config=_spec(permuted_copy(target, tmp_path / "permuted"), num_speculative_tokens=4))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    taken = sum(o.metrics["accepted_tokens"] for o in outs) / sum(o.metrics["draft_tokens"] for o in outs)
    assert taken > 0.9, taken


def test_chat_with_two_chat_templates_is_identical(plain, tiny_llama_dir: Path, sp_dir: Path) -> None:  # noqa: ANN001
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    want = [o.token_ids for o in plain[0].chat(messages, GREEDY)]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=_spec(sp_dir))
    assert [o.token_ids for o in llm.chat(messages, GREEDY)] == want


def test_sampling_reproduces_with_its_seed(tiny_llama_dir: Path, sp_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu",
              speculative_config=_spec(sp_dir, num_speculative_tokens=4))
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == first
    assert all(len(ids) == 24 for ids in first)


def test_a_cross_vocabulary_tree_is_refused(tiny_llama_dir: Path, sp_dir: Path) -> None:
    with pytest.raises(IncompatibleDraftError, match="chains only"):
        LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=_spec(sp_dir, draft_tree_width=2))


def test_lookup_guesses_ride_along_in_the_draft_ids(tmp_path: Path) -> None:
    """Where an earlier answer holds what the draft is about to draft, one forward carries the guess (re-spelled
    in the draft's ids) and confirms it: the same draft in far fewer draft forwards."""
    from specdecode.proposers.base import ProposeRow, SequenceView
    from specdecode.proposers.suffix_index import SuffixStore
    from specdecode.proposers.suffix_source import SuffixSource

    target = make_tiny_hf_dir(tmp_path / "ascii", save_tokenizer=save_ascii_tokenizer)
    llm = LLM(str(target), dtype="fp32", device="cpu", speculative_config=_spec(
        permuted_copy(target, tmp_path / "permuted"), num_speculative_tokens=4))
    prompt = llm.tokenizer.encode("def add(a, b):\n")
    answer = llm.generate([prompt], GREEDY)[0].token_ids
    proposer = llm.engine.proposer
    assert isinstance(proposer, CrossVocabDraftRows)
    drafts, forwards = [], []
    for lookup in (None, SuffixSource(2, SuffixStore("global"))):
        if lookup is not None:
            lookup.remember(None, prompt + answer, len(prompt))
        rows = CrossVocabDraftRows(proposer.model, 256, proposer.bridge, lookup)
        seq = SequenceView(prompt + answer[:3], len(prompt), SamplingParams(temperature=0), torch.Generator())
        rows.begin(0, seq)
        drafts.append(rows.propose([ProposeRow(0, seq, 12, 12)])[0].tokens)
        forwards.append(rows.forwards)
    assert drafts[0] == drafts[1] == answer[3:15]  # the target's own continuation, drafted either way
    assert forwards[1] <= 3 < forwards[0], forwards


def test_the_draft_cache_after_partial_acceptances_is_a_fresh_read_of_the_text(tiny_llama_dir: Path,
                                                                               sp_dir: Path) -> None:
    """Steps that accept part of a draft (or none) and go on with the target's own tokens leave the draft's cache
    as a fresh draft row would build it from the whole text: the same ids, the same K/V, the same next draft."""
    from specdecode.proposers.base import ProposeRow, SequenceView

    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config=_spec(sp_dir))
    proposer = llm.engine.proposer
    assert isinstance(proposer, CrossVocabDraftRows)
    prompt = llm.tokenizer.encode("Héllo wörld € 你好  x")
    answer = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].token_ids
    lived = CrossVocabDraftRows(proposer.model, 256, proposer.bridge)
    n = 0
    for step, accepted in enumerate([0, 2, 1, 0, 3, 1, 2, 0]):
        seq = SequenceView(prompt + answer[:n], len(prompt), SamplingParams(temperature=0), torch.Generator())
        if step == 0:
            lived.begin(0, seq)
        draft = lived.propose([ProposeRow(0, seq, 4, 4)])[0]
        fresh = CrossVocabDraftRows(proposer.model, 256, proposer.bridge)
        fresh.begin(0, seq)
        assert fresh.propose([ProposeRow(0, seq, 4, 4)])[0].tokens == draft.tokens, step
        kept = min(lived.rows[0].num_cached, fresh.rows[0].num_cached)
        assert lived.texts[0].ids[:kept] == fresh.texts[0].ids[:kept]
        for mine, theirs in zip(lived.cache.cache.read_span(lived.rows[0].slot, 0, kept),  # type: ignore[union-attr]
                                fresh.cache.cache.read_span(fresh.rows[0].slot, 0, kept), strict=True):  # type: ignore[union-attr]
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
        n += accepted + 1  # the target keeps `accepted` tokens (its own, whatever was drafted) and adds one
        lived.on_verified(0, SequenceView(prompt + answer[:n], len(prompt), seq.params, seq.generator), accepted,
                          accepted)


def test_a_padding_id_the_target_emits_spells_nothing(tiny_llama_dir: Path, sp_dir: Path) -> None:
    """Models pad their output rows beyond the tokenizer; an id there (vanishingly rare) reads as no text."""
    bridge = TextBridge(_tok(tiny_llama_dir), _tok(sp_dir))
    beyond = len(bridge.target_bytes) + 5
    ids = bridge.target_encode("def add")
    row = DraftText()
    bridge.sync(row, [*ids, beyond], 0)
    assert bytes(row.raw) == b"def add" and bridge.target_spelling([beyond]) == b""
