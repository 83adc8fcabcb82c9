"""EAGLE and Medusa heads: exact greedy output with untrained heads, save/load, refusal for another
target, and the train-head pipeline (features, training, resume) on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_helpers import GREEDY, run_batched, tiny_prompts

from specdecode import LLM, SamplingParams
from specdecode.config import SpeculativeConfig
from specdecode.heads.features import generate_features, load_shard
from specdecode.heads.modules import IncompatibleHeadError
from specdecode.heads.persist import load_head, new_head, save_head
from specdecode.heads.train import Corpus, TrainOptions, _eagle_step_loss, train_head, window_batch
from specdecode.model.load import load_model


@pytest.fixture(scope="module")
def random_heads(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untrained heads over half the vocabulary (a reduced draft vocabulary)."""
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    out = {}
    for kind in ("eagle", "medusa"):
        head = new_head(target, kind, torch.arange(0, target.config.vocab_size, 2), seed=3)
        out[kind] = tmp_path_factory.mktemp(kind)
        save_head(head, out[kind])
    return out


@pytest.mark.parametrize("width", [None, 1, 3])
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_random_head_greedy_equals_plain(plain_tiny, tiny_llama_dir: Path, random_heads, kind: str,
                                         width: int | None) -> None:
    base, ref = plain_tiny
    spec = {"method": kind, "model": str(random_heads[kind]), "draft_tree_width": width, "num_speculative_tokens": 4}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    outs = llm.generate(tiny_prompts(base), GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert outs[0].metrics["draft_tokens"] >= outs[0].metrics["steps"]  # it did draft


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_small_vocab_head_on_tied_target_keeps_greedy_output(tiny_tied_dir: Path, tmp_path: Path, kind: str) -> None:
    """A head over a tenth of a tied target's vocabulary: still exactly plain decoding."""
    plain = LLM(str(tiny_tied_dir), dtype="fp32")
    prompts = tiny_prompts(plain)
    ref = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    target = load_model(str(tiny_tied_dir), "fp32", "cpu").model
    save_head(new_head(target, kind, torch.arange(0, target.config.vocab_size, 10), seed=2), tmp_path)
    spec = {"method": kind, "model": str(tmp_path), "num_speculative_tokens": 3}
    outs = LLM(str(tiny_tied_dir), dtype="fp32", speculative_config=spec).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref


def test_head_prompt_tokens_is_an_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"unknown speculative config keys \['head_prompt_tokens'\]"):
        SpeculativeConfig.from_any({"method": "eagle", "head_prompt_tokens": True})


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_head_sampling_is_seeded_and_bounded(tiny_llama_dir: Path, random_heads, kind: str) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": kind, "model": str(random_heads[kind])})
    # ignore_eos: the adaptive draft length follows measured forward costs, so which random numbers a
    # sample uses (and whether this random model ever samples EOS) can change from run to run.
    params = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2, seed=7,
                            ignore_eos=True)
    a, b = llm.generate(tiny_prompts(llm), params), llm.generate(tiny_prompts(llm), params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 15 for o in a)


def test_head_round_trips(tiny_llama_dir: Path, tmp_path: Path) -> None:
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    head = new_head(target, "eagle", torch.arange(0, 100), intermediate_size=96, seed=5)
    save_head(head, tmp_path / "h")
    loaded = load_head(tmp_path / "h", target, kind="eagle")
    assert loaded.config == head.config
    for name, value in head.saved_state().items():
        assert torch.equal(loaded.saved_state()[name], value), name
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight[:100])  # rebuilt from the target
    with pytest.raises(IncompatibleHeadError, match="medusa head"):
        load_head(tmp_path / "h", target, kind="medusa")


def test_head_for_another_target_is_refused(tiny_llama_dir: Path, tiny_qwen_dir: Path, random_heads) -> None:
    with pytest.raises(IncompatibleHeadError, match="trained for target") as info:
        LLM(str(tiny_qwen_dir), dtype="fp32",
            speculative_config={"method": "eagle", "model": str(random_heads["eagle"])})
    assert "embedding_sha" in str(info.value)  # both fingerprints are named


def test_not_a_head_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(IncompatibleHeadError, match="not a saved head"):
        LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "eagle", "model": str(tmp_path)})


@pytest.fixture(scope="module")
def tiny_features(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    loaded = load_model(str(tiny_llama_dir), "fp32", "cpu")
    out = tmp_path_factory.mktemp("features")
    shards = generate_features(loaded.model, loaded.tokenizer, out, num_tokens=3000, shard_tokens=1000)
    return out, shards


def test_features_are_the_targets_hidden_states(tiny_llama_dir: Path, tiny_features) -> None:
    out, shards = tiny_features
    assert len(shards) == 3
    loaded = load_model(str(tiny_llama_dir), "fp32", "cpu")
    shard = load_shard(shards[0])
    a, b = shard.sequences()[0]
    ids = shard.tokens[a:b]
    cache = loaded.model.new_cache(1, len(ids))
    hidden = loaded.model(ids[None], torch.arange(len(ids))[None], cache)[0]
    torch.testing.assert_close(shard.hidden[a:b].float(), hidden, atol=0.05, rtol=0.02)  # stored in bf16
    assert torch.equal(shard.target_next[a:b], loaded.model.compute_logits(hidden).argmax(-1))
    # A rerun finds every shard done and recomputes nothing.
    mtimes = [p.stat().st_mtime_ns for p in shards]
    assert generate_features(loaded.model, loaded.tokenizer, out, 3000, shard_tokens=1000) == shards
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    with pytest.raises(ValueError, match="other settings"):
        generate_features(loaded.model, loaded.tokenizer, out, 3000, shard_tokens=500)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_training_learns_and_resumes(tiny_llama_dir: Path, tiny_features, tmp_path: Path, kind: str) -> None:
    """Training lowers the loss on a fixed batch (the first windows, fixed feature noise: no sampling luck), and
    a run stopped and resumed twice ends with exactly the weights of an uninterrupted one."""
    _, shards = tiny_features
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model

    def options(max_steps: int | None) -> TrainOptions:
        return TrainOptions(kind=kind, epochs=12, window=64, batch_windows=4, lr=3e-3, warmup_steps=5,
                            draft_vocab_size=200, checkpoint_every=5, max_steps=max_steps, unroll_steps=2,
                            normalize_regression=True)

    def record(out: Path) -> dict:
        return json.loads((out / "training.json").read_text())

    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    train_head(target, shards, resumed, options(0), always_ids=[2])  # no step: the initial head
    untrained = record(resumed)["fixed_batch_loss"]
    assert untrained["start"] == untrained["end"] and untrained["windows"] > 0
    assert train_head(target, shards, resumed, options(7), always_ids=[2]).config.training["steps"] == 7
    head = train_head(target, shards, resumed, options(20), always_ids=[2])
    assert record(resumed)["resumed_from"] == 7 and (resumed / "checkpoint.pt").exists()
    ref = train_head(target, shards, straight, options(20), always_ids=[2])
    assert record(straight)["fixed_batch_loss"]["start"] == untrained["start"]  # the same initial head
    for name, value in ref.saved_state().items():  # stopped and resumed mid-pass = never stopped
        assert torch.equal(head.saved_state()[name], value), name
    assert record(resumed)["fixed_batch_loss"]["end"] == record(straight)["fixed_batch_loss"]["end"]

    head = train_head(target, shards, resumed, options(None), always_ids=[2])  # on to the end
    info = record(resumed)
    assert info["resumed_from"] == 20 and info["steps"] == info["total_steps"] > 100
    assert 2 in head.d2t.tolist()  # EOS is always in the draft vocabulary
    # Measured: EAGLE 3.0 -> 1.7, Medusa 20.3 -> 16.4 (its two-ahead guesses are hard on a random model).
    assert info["fixed_batch_loss"]["end"] < (0.75 if kind == "eagle" else 0.9) * untrained["start"], info
    # The trained head drives decoding and output stays exact.
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": kind, "model": str(resumed)})
    base = LLM(str(tiny_llama_dir), dtype="fp32")
    prompts = tiny_prompts(base)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in base.generate(prompts, GREEDY)]


def test_soft_distillation_targets_the_targets_distribution(tiny_llama_dir: Path, tiny_features) -> None:
    """--distill soft: the token loss is the cross-entropy against softmax of the target's own logits over the
    draft vocabulary, so a head predicting the target's next feature exactly scores the entropy of that
    distribution (its minimum), and anything else more; "hard" ignores all but the greedy token."""
    _, shards = tiny_features
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    d2t = torch.arange(0, target.config.vocab_size, 2)
    head = new_head(target, "eagle", d2t, seed=1).float()
    corpus = Corpus.from_shards(shards, window=32)
    feats, toks, nxt, labels, mask = window_batch(corpus, corpus.windows[:2])
    t2d = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    soft, hard = TrainOptions(distill="soft", ce_weight=1.0), TrainOptions(distill="hard", ce_weight=1.0)
    ones = torch.ones(nxt.shape[-1])
    probs = torch.softmax(target.compute_logits(nxt[mask])[:, d2t].float(), -1)  # [M, Vd] the target's own
    entropy = -(probs * probs.log()).sum(-1).mean().item()
    _, _, ce_exact, _ = _eagle_step_loss(head, nxt, nxt, labels, mask, t2d, soft, ones)
    assert ce_exact == pytest.approx(entropy, rel=1e-4)
    off = nxt + 0.5 * torch.randn(nxt.shape, generator=torch.Generator().manual_seed(0))
    assert _eagle_step_loss(head, off, nxt, labels, mask, t2d, soft, ones)[2] > ce_exact + 1e-3
    # The hard loss differs: only the greedy token counts (a sharper target than the whole distribution).
    assert _eagle_step_loss(head, nxt, nxt, labels, mask, t2d, hard, ones)[2] < ce_exact


def test_training_starts_from_a_saved_head(tiny_llama_dir: Path, tiny_features, tmp_path: Path) -> None:
    """--init-from: fine-tuning starts at the saved head's weights and keeps its draft vocabulary and sizes."""
    _, shards = tiny_features
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    opts = TrainOptions(kind="eagle", epochs=1, window=64, batch_windows=4, draft_vocab_size=200,
                        intermediate_size=96, max_steps=3)
    base = train_head(target, shards, tmp_path / "base", opts, always_ids=[2])
    tuned_opts = TrainOptions(kind="eagle", epochs=1, window=64, batch_windows=4, draft_vocab_size=300,
                              max_steps=0, init_from=str(tmp_path / "base"))
    same = train_head(target, shards, tmp_path / "tuned", tuned_opts, always_ids=[2])  # no steps: the start
    assert same.config.intermediate_size == 96 and torch.equal(same.d2t, base.d2t)
    vocab = target.config.vocab_size
    assert len(base.d2t) < vocab
    tuned_opts.draft_vocab_first = vocab  # --draft-vocab-first widens the starting head's vocabulary
    wide = train_head(target, shards, tmp_path / "wide", tuned_opts, always_ids=[2])
    assert wide.d2t.tolist() == list(range(vocab))
    assert torch.equal(wide.saved_state()["fc.weight"], same.saved_state()["fc.weight"])  # same weights
    tuned_opts.draft_vocab_first = 0
    saved = load_head(tmp_path / "base", target, dtype=torch.float32).saved_state()
    for name, value in same.saved_state().items():
        assert torch.allclose(value.float(), saved[name].float()), name
    tuned_opts.max_steps = 2
    moved = train_head(target, shards, tmp_path / "tuned", tuned_opts, always_ids=[2])  # resumes its checkpoint
    assert moved.config.training["steps"] == 2
    assert moved.config.training["init_from_training"]["steps"] == 3  # the run it started from, on record
    assert json.loads((tmp_path / "tuned" / "training.json").read_text())["init_from_training"]["steps"] == 3
    assert not torch.equal(moved.saved_state()["fc.weight"], same.saved_state()["fc.weight"])


@pytest.mark.real
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_random_head_greedy_equals_plain_smollm(tmp_path: Path, kind: str) -> None:
    base = LLM("smollm2-135m-instruct", dtype="fp32")
    head = new_head(base.target.model, kind, torch.arange(0, base.target.config.vocab_size, 3), seed=1)
    save_head(head, tmp_path)
    prompts = [base.chat_prompt_ids([{"role": "user", "content": "Write a Python function that adds numbers."}])]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    llm = LLM("smollm2-135m-instruct", dtype="fp32", speculative_config={"method": kind, "model": str(tmp_path)})
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_heads_in_continuous_batching_keep_greedy_output(plain_tiny, tiny_llama_dir: Path, random_heads,
                                                         kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine feeds every row's proposer the target's features; rows draft trees, with the lookup branch
    grafted onto them (here a guess is always found, and the lookup-or-tree choice, tested on its own in
    test_tree_engine.py, is off so that every step drafts a tree)."""
    monkeypatch.setattr("specdecode.proposers.suffix_source.SuffixSource.trie",
                        lambda self, tokens, tenant, depth, *shared: SimpleNamespace(chain=lambda k: [5, 6, 7][:k]))
    monkeypatch.setattr("specdecode.engine.core.guess_alone", lambda *args: [])
    base, ref = plain_tiny
    llm = LLM(str(tiny_llama_dir), dtype="fp32",
              speculative_config={"method": kind, "model": str(random_heads[kind]), "num_speculative_tokens": 3})
    seqs = run_batched(llm, tiny_prompts(base), GREEDY)
    assert [s.output_ids for s in seqs] == ref
    assert all(s.stats.draft_tokens > sum(s.stats.drafted_by_position) for s in seqs)  # trees: nodes > positions


def test_self_distilled_answers_are_cached_and_resumed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from specdecode.heads.selfgen import self_distill_requests, self_distilled_conversations

    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram"})
    # the three shortest of 30 (the corpus includes installed packages' descriptions, which vary)
    requests = sorted(self_distill_requests(30), key=len)[:3]
    assert len(set(requests)) == 3
    path = tmp_path / "answers.jsonl"
    first = self_distilled_conversations(llm, requests[:2], path, max_tokens=6)
    assert [c[0]["content"] for c in first] == requests[:2] and all(c[1]["role"] == "assistant" for c in first)
    again = self_distilled_conversations(llm, requests, path, max_tokens=6)  # generates only the third
    assert again[:2] == first and len(path.read_text().splitlines()) == 3


def test_diverse_requests_and_batched_answers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The diverse request set mixes task kinds without repeats; answering with continuous batching gives
    the answers of one request at a time, in request order."""
    from specdecode.heads.selfgen import diverse_requests, self_distilled_conversations

    requests = diverse_requests(60)
    assert len(set(requests)) == 60 and requests == diverse_requests(60)  # fixed by the seed
    openings = {r.split()[0] for r in requests}
    assert {"Translate", "Summarize", "Read", "Rewrite", "Write"} <= openings
    llm = LLM(str(tiny_llama_dir), dtype="fp32")
    short = sorted(requests, key=len)[:5]
    one = self_distilled_conversations(llm, short, tmp_path / "one.jsonl", max_tokens=6)
    batched = self_distilled_conversations(llm, short, tmp_path / "batched.jsonl", max_tokens=6, batch=3)
    assert batched == one and [c[0]["content"] for c in batched] == short
    # A larger set copies the answers a smaller one already has (no model needed for them).
    reused = self_distilled_conversations(None, short[:3], tmp_path / "larger.jsonl", reuse=[tmp_path / "one.jsonl"])
    assert reused == one[:3] and len((tmp_path / "larger.jsonl").read_text().splitlines()) == 3


def test_back_translation_requests() -> None:
    """Answers to "Translate into X:" become "Translate X to English:" requests; other answers, empty or
    essay-like ones, and repeats are left out."""
    from specdecode.heads.selfgen import back_translation_requests

    def conv(request: str, answer: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]

    convs = [conv("Translate into German:\nThe cat sleeps.", "Die Katze schläft."),
             conv("Translate into French:\nIt rains.", " "),
             conv("Translate into Dutch:\nA.", "1\n2\n3\n4\n5"),
             conv("Translate into German:\nB.", "lang " * 200),
             conv("Explain DNA in simple terms.", "DNA is ..."),
             conv("Translate into German:\nThe cat sleeps!", "Die Katze schläft.")]
    assert back_translation_requests(convs) == ["Translate German to English: Die Katze schläft."]


@pytest.mark.parametrize("quantization", ["none", "int8-dynamic"])
def test_train_head_data_only_with_batched_self_distillation(tiny_llama_dir: Path, tmp_path: Path,
                                                             quantization: str) -> None:
    """`train-head --data-only` writes corpus features and the self-distilled answers' features (answered
    in batches, on either target format; features always from the bf16 target), then stops."""
    from specdecode.cli import main

    data = tmp_path / "data"
    rc = main(["train-head", "--target", str(tiny_llama_dir), "--out", str(tmp_path / "head"), "--data-dir", str(data),
               "--data-tokens", "256", "--self-distill-diverse", "3",
               "--self-distill-batch", "2", "--self-distill-quantization", quantization, "--data-only",
               "--threads", "1"])
    assert rc == 0 and not (tmp_path / "head").exists()
    assert len((data / "self-answers-diverse-3.jsonl").read_text().splitlines()) == 3
    shards = sorted((data / "self-diverse-3").glob("shard-*.safetensors"))
    assert shards and load_shard(shards[0]).hidden.shape[-1] == 64


def test_written_request_prompts_cover_every_kind_and_are_fixed_by_the_seed() -> None:
    from specdecode.heads.written import REQUEST_KINDS, written_request_prompts

    prompts = written_request_prompts(2 * len(REQUEST_KINDS))
    assert prompts == written_request_prompts(2 * len(REQUEST_KINDS))
    assert written_request_prompts(5) == prompts[:5]  # a larger set starts with a smaller one
    assert sum(p.startswith("Write two or three sentences in ") for p in prompts) == 4
    assert all("{" not in p for p in prompts)


def test_clean_written_request() -> None:
    """The request in the target's reply: preambles, labels and quotes go; a reply with no request is
    refused; a text in another language becomes a request to translate it into English."""
    from specdecode.heads.written import clean_written_request

    ask = "Write one short factual question about volcanoes. Reply with the question only."
    assert clean_written_request(ask, '"Why do volcanoes erupt?"') == "Why do volcanoes erupt?"
    assert clean_written_request(ask, "Sure, here is one:\n\n**Question:** Why do volcanoes erupt?") == \
        "Why do volcanoes erupt?"
    assert clean_written_request(ask, "Sure, what topic would you like?") is None
    assert clean_written_request(ask, "Why?") is None
    assert clean_written_request(ask, "x" * 2000) is None
    two_lines = "A bakery sells 40 rolls a day.\nHow many does it sell in a week?"
    assert clean_written_request(ask, two_lines) == two_lines
    german = "Write two or three sentences in German about trains. Reply with the German text only."
    want = "Translate German to English: Der Zug fährt schnell."
    assert clean_written_request(german, "Der Zug fährt schnell.") == want


def test_written_requests_are_cached_and_resumed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The target writes the requests (sampled with a seed per request, so a rerun gives the same ones);
    the raw replies are cached and a larger set only writes the new ones."""
    from specdecode.heads.written import written_request_prompts, written_requests

    llm = LLM(str(tiny_llama_dir), dtype="fp32")
    path = tmp_path / "written.jsonl"
    first = written_requests(llm, 3, path, batch=2, max_tokens=24)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["seed"] for r in rows) == [0, 1, 2]
    assert [r["prompt"] for r in sorted(rows, key=lambda r: r["seed"])] == written_request_prompts(3)
    again = written_requests(llm, 4, path, batch=2, max_tokens=24)
    assert len(path.read_text().splitlines()) == 4 and all(r in again for r in first)
    fresh = written_requests(llm, 3, tmp_path / "fresh.jsonl", batch=1, max_tokens=24)  # one at a time, same seeds
    assert fresh == first
    # A larger set in another file copies the replies of a smaller one (same seed and prompt) and writes the rest.
    def no_generation(*_args, **_kwargs) -> None:
        raise RuntimeError("generated")

    llm.generate = no_generation  # type: ignore[method-assign] - copying must not generate
    larger = tmp_path / "written-5.jsonl"
    with pytest.raises(RuntimeError, match="generated"):  # seed 4 is new: only it has to be written
        written_requests(llm, 5, larger, batch=1, max_tokens=24, reuse=[path])
    copied = {json.loads(line)["seed"]: json.loads(line) for line in larger.read_text().splitlines()}
    assert sorted(copied) == [0, 1, 2, 3] and all(copied[r["seed"]] == r for r in rows)


def test_saved_texts_seed_the_data_directory(tmp_path: Path) -> None:
    """The repository's saved requests and answers are copied into a data directory that lacks them; files
    already there are never overwritten (a longer cached run keeps its own)."""
    from specdecode.train_cli import seed_data_dir

    saved = tmp_path / "saved" / "my-target"
    saved.mkdir(parents=True)
    (saved / "written-requests-8.jsonl").write_text('{"seed": 0}\n')
    (saved / "self-answers-written-8.jsonl").write_text('{"a": 1}\n')
    (saved / "notes.md").write_text("not data")
    data = tmp_path / "cache" / "my-target"
    data.mkdir(parents=True)
    (data / "self-answers-written-8.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    copied = seed_data_dir(data, "/models/my-target", saved=tmp_path / "saved")
    assert copied == [data / "written-requests-8.jsonl"]
    assert (data / "written-requests-8.jsonl").read_text() == '{"seed": 0}\n'
    assert (data / "self-answers-written-8.jsonl").read_text().count("\n") == 2  # untouched
    assert not (data / "notes.md").exists()
    assert seed_data_dir(data, "other-target", saved=tmp_path / "saved") == []


def test_a_larger_written_set_reuses_a_smaller_ones_requests_and_answers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`--self-distill-written 3` after a run of 2: the two requests and their answers are copied (seeds and
    prompts match), only the third is written and answered."""
    from specdecode.cli import main
    from specdecode.heads.written import written_request_prompts

    data = tmp_path / "data"
    data.mkdir()
    prompts = written_request_prompts(2)
    requests = ["Describe a quiet harbour town at dawn.", "Explain why the sky looks blue at noon."]
    (data / "written-requests-2.jsonl").write_text("".join(
        json.dumps({"seed": i, "prompt": prompts[i], "reply": requests[i]}) + "\n" for i in range(2)))
    answers = [[{"role": "user", "content": r}, {"role": "assistant", "content": f"Seeded answer {i}."}]
               for i, r in enumerate(requests)]
    (data / "self-answers-written-2.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    rc = main(["train-head", "--target", str(tiny_llama_dir), "--out", str(tmp_path / "head"), "--data-dir", str(data),
               "--data-tokens", "0", "--self-distill-written", "3", "--self-distill-batch", "2", "--data-only",
               "--threads", "1"])
    assert rc == 0
    rows = {json.loads(line)["seed"]: json.loads(line) for line in (data / "written-requests-3.jsonl").open()}
    assert sorted(rows) == [0, 1, 2] and [rows[i]["reply"] for i in range(2)] == requests
    convs = [json.loads(line) for line in (data / "self-answers-written-3.jsonl").open()]
    assert all(a in convs for a in answers)
    assert sorted((data / "self-written-3").glob("shard-*.safetensors"))
