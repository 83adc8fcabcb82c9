"""Batch-first drafting: one batched proposal equals each row's own proposal (the row drafting alone), and a
batch proposer's `state_bytes` is what its rows allocate.

Tiny random models in fp32; rows differ in context length, draft length and how far behind their drafting
state is (a fresh row catches up on its whole prompt while another feeds one token), and a second step
follows a partial acceptance. Same tokens (and tree shapes), probabilities allclose.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.heads.persist import new_head
from specdecode.model.config import ModelConfig
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Draft, ProposeRow, SequenceView
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.eagle_rows import EagleRows
from specdecode.proposers.medusa_rows import MedusaRows
from specdecode.proposers.ngram import NgramRows
from specdecode.proposers.row_packing import RowInput, pack
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.sampling import SamplingParams

VOCAB = 48
MAX_LEN = 96


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _model(seed: int) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.6)
    return model.fuse_projections().eval()


DRAFT = _model(3)


def _contexts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 23, 11, 40, 2]
    out = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    out[2] = [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6]  # a loop: lookup guesses ride along
    return out


def _views(temperature: float) -> list[SequenceView]:
    params = SamplingParams(temperature=temperature, top_k=12 if temperature else -1)
    return [SequenceView(list(c), max(1, len(c) - 3), params, torch.Generator().manual_seed(i))
            for i, c in enumerate(_contexts())]


def _same(a: Draft, b: Draft) -> None:
    assert a.tokens == b.tokens and a.parents == b.parents
    assert (a.probs is None) == (b.probs is None)
    if a.probs is not None:
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-4, atol=1e-6)


def _two_steps(propose, verified, views: list[SequenceView], ks: list[int]) -> list[list[Draft]]:  # noqa: ANN001
    """Two proposals per row; between them each row keeps two drafts and gets one new token."""
    first = propose(views, ks)
    for i, (v, d) in enumerate(zip(views, first, strict=True)):
        kept = min(2, len(d.tokens)) if d.parents is None else 0
        v.token_ids += d.tokens[:kept] + [(7 * i + 1) % VOCAB]
        verified(i, v, kept)
    return [first, propose(views, ks)]


@pytest.mark.parametrize(("temperature", "tree_width", "lookup"),
                         [(0.0, 1, None), (1.0, 1, None), (0.0, 1, SuffixSource(1)), (1.0, 1, SuffixSource(1)),
                          (0.0, 2, None), (0.0, 0, None)],
                         ids=["greedy", "sampled", "greedy-lookup", "sampled-lookup", "tree", "dynamic-tree"])
def test_batched_draft_model_equals_per_row(temperature: float, tree_width: int, lookup) -> None:  # noqa: ANN001
    ks = [3, 4, 5, 2, 4]
    budget = 10
    singles = [DraftModelRows(DRAFT, MAX_LEN, tree_width, 2, lookup) for _ in ks]  # a proposer per row
    views = _views(temperature)
    for p, v in zip(singles, views, strict=True):
        p.begin(0, v)

    def one(vs: list[SequenceView], ks: list[int]) -> list[Draft]:
        return [p.propose([ProposeRow(0, v, k, budget)])[0] for p, v, k in zip(singles, vs, ks, strict=True)]

    calls = []
    hook = DRAFT.register_forward_hook(lambda *_: calls.append(1))
    ref = _two_steps(one, lambda i, v, n: singles[i].on_verified(0, v, n, n), views, ks)
    per_row_forwards, calls[:] = len(calls), []

    batched = DraftModelRows(DRAFT, MAX_LEN, tree_width, 2, lookup)
    views = _views(temperature)
    for key, v in enumerate(views):
        batched.begin(key, v)

    def together(vs: list[SequenceView], ks: list[int]) -> list[Draft]:
        return batched.propose([ProposeRow(i, v, k, budget) for i, (v, k) in enumerate(zip(vs, ks, strict=True))])

    got = _two_steps(together, lambda i, v, n: batched.on_verified(i, v, n, n), views, ks)
    hook.remove()
    for step_ref, step_got in zip(ref, got, strict=True):
        for a, b in zip(step_ref, step_got, strict=True):
            _same(a, b)
    assert len(calls) == batched.forwards <= per_row_forwards / 2  # one forward serves every row


def _greedy_continuation(ids: list[int], n: int) -> list[int]:
    """The draft's own n greedy tokens after ids, each from a forward over the whole sequence (no cache kept)."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            hidden = DRAFT(torch.tensor([ids]), torch.arange(len(ids))[None], DRAFT.new_cache(1, len(ids)))
            out.append(int(DRAFT.compute_logits(hidden[0, -1]).argmax()))
            ids.append(out[-1])
    return out


def test_a_greedy_chain_is_the_draft_models_own_continuation() -> None:
    """Against a reference without a cache: rows catching up on prompts of different lengths, then a second step
    after a partial acceptance, each draft the draft model's greedy continuation of its row."""
    ks = [3, 4, 5, 2, 4]
    rows = DraftModelRows(DRAFT, MAX_LEN)
    views = _views(0.0)
    for key, v in enumerate(views):
        rows.begin(key, v)
    seen: list[list[list[int]]] = []

    def propose(vs: list[SequenceView], ks: list[int]) -> list[Draft]:
        seen.append([list(v.token_ids) for v in vs])
        return rows.propose([ProposeRow(i, v, k, k) for i, (v, k) in enumerate(zip(vs, ks, strict=True))])

    steps = _two_steps(propose, lambda i, v, n: rows.on_verified(i, v, n, n), views, ks)
    for contexts, drafts in zip(seen, steps, strict=True):
        for ids, k, draft in zip(contexts, ks, drafts, strict=True):
            assert draft.tokens == _greedy_continuation(ids, k)


def test_rows_join_and_leave_between_steps() -> None:
    """A released row's cache row is reused; a row drafting alone gives what it gives in a batch."""
    views = _views(0.0)
    batched = DraftModelRows(DRAFT, MAX_LEN)
    for key in range(3):
        batched.begin(key, views[key])
    batched.propose([ProposeRow(key, views[key], 3, 3) for key in range(3)])
    batched.release(1)
    batched.begin(7, views[3])
    assert batched.rows[7].slot == 1
    got = batched.propose([ProposeRow(7, views[3], 4, 4)])
    alone = DraftModelRows(DRAFT, MAX_LEN)
    alone.begin(0, views[3])
    _same(alone.propose([ProposeRow(0, views[3], 4, 4)])[0], got[0])


def test_pack_pads_to_scratch_slots() -> None:
    packed = pack({0: RowInput([5, 6, 7], [2, 3, 4], [2, 3, 4]), 2: RowInput([9], [0], [0])}, 3, [0, 4, 0])
    assert packed.lengths == [3, 0, 1]
    assert packed.slots.tolist() == [[2, 3, 4], [4, 4, 4], [0, 1, 1]]
    assert packed.mask.shape == (3, 3, 6)
    assert packed.mask[0, 2].tolist() == [True] * 5 + [False]  # causal: slot 4 sees slots 0..4
    assert packed.mask[1, 0].nonzero().flatten().tolist() == [4]  # an idle row's padding sees its own slot
    assert packed.mask[2, 1].nonzero().flatten().tolist() == [1]


@pytest.mark.parametrize("tree_width", [0, 1, 3], ids=["dynamic-tree", "chain", "tree"])
def test_batched_eagle_equals_per_row(tree_width: int) -> None:
    """Heads read the target's features: random ones per position, the same for both proposers."""
    target = _model(4)
    head = new_head(target, "eagle", torch.arange(0, VOCAB, 2), seed=2)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)  # peaked logits: no near-ties between a wide and a narrow forward
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(MAX_LEN, 32, generator=gen)  # [position, D]
    ks, budget = [3, 4, 5, 2, 4], 12

    def run(propose, begin, observe, verified) -> list[list[Draft]]:  # noqa: ANN001
        views = _views(0.0)
        for i, v in enumerate(views):
            begin(i, v)
            observe(i, feats[: len(v.token_ids) - 1])  # the prefill's features (all but the pending token)
        first = propose(views)
        for i, (v, d) in enumerate(zip(views, first, strict=True)):
            kept = [t for t, p in zip(d.tokens, d.parents or [], strict=True) if p == 0][:1]
            n = len(v.token_ids)
            v.token_ids += kept + [(5 * i + 2) % VOCAB]
            observe(i, feats[n - 1 : n + len(kept)])
            verified(i, v, len(kept))
        return [first, propose(views)]

    singles = [EagleRows(head, MAX_LEN, tree_width, 3) for _ in ks]  # a proposer per row
    ref = run(lambda vs: [p.propose([ProposeRow(0, v, k, budget)])[0] for p, v, k in zip(singles, vs, ks, strict=True)],
              lambda i, v: singles[i].begin(0, v), lambda i, h: singles[i].observe_hidden(0, h),
              lambda i, v, n: singles[i].on_verified(0, v, n, n))
    rows = EagleRows(head, MAX_LEN, tree_width, 3)
    got = run(lambda vs: rows.propose([ProposeRow(i, v, k, budget) for i, (v, k) in enumerate(zip(vs, ks, strict=True))
                                       ]),
              rows.begin, rows.observe_hidden, lambda i, v, n: rows.on_verified(i, v, n, n))
    for step_ref, step_got in zip(ref, got, strict=True):
        for a, b in zip(step_ref, step_got, strict=True):
            _same(a, b)
    assert any(len(d.tokens) > 1 for d in got[1])


def test_eagle_measures_its_level_cost_on_a_scratch_row_that_leaves_no_trace() -> None:
    """The step cost is timed through `propose` itself, on a row of its own: rows drafting before and after the
    measurement draft what they draft without it, and no cache row stays taken."""
    target = _model(4)
    head = new_head(target, "eagle", torch.arange(0, VOCAB, 2), seed=2)
    feats = torch.randn(MAX_LEN, 32, generator=torch.Generator().manual_seed(1))  # [position, D]
    drafts = []
    for measure in (False, True):
        rows = EagleRows(head, MAX_LEN, 0, 3)
        view = _views(0.0)[3]
        rows.begin(0, view)
        rows.observe_hidden(0, feats[: len(view.token_ids) - 1])
        if measure:
            assert rows.step_cost_hint() > 0
            assert rows.cache.used == {0} and set(rows.rows) == {0}
        drafts.append(rows.propose([ProposeRow(0, view, 4, 12)])[0])
    _same(drafts[0], drafts[1])


@pytest.mark.parametrize("tree_width", [0, 1, 3], ids=["dynamic-tree", "chain", "tree"])
def test_batched_medusa_equals_per_row(tree_width: int) -> None:
    """Every row's heads run in one forward over the rows' newest features: each row drafts what it drafts alone."""
    target = _model(4)
    head = new_head(target, "medusa", torch.arange(0, VOCAB, 2), seed=2)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)  # peaked logits: no near-ties between a wide and a narrow forward
    feats = torch.randn(MAX_LEN, 32, generator=torch.Generator().manual_seed(1))  # [position, D]
    ks, budget = [3, 4, 5, 2, 4], 12
    views = _views(0.0)
    singles = [MedusaRows(head, tree_width) for _ in ks]  # a proposer per row
    rows = MedusaRows(head, tree_width)
    for i, v in enumerate(views):
        for proposer, key in ((singles[i], 0), (rows, i)):
            proposer.begin(key, v)
            proposer.observe_hidden(key, feats[: len(v.token_ids) - 1])
    ref = [p.propose([ProposeRow(0, v, k, budget)])[0] for p, v, k in zip(singles, views, ks, strict=True)]
    got = rows.propose([ProposeRow(i, v, k, budget) for i, (v, k) in enumerate(zip(views, ks, strict=True))])
    for a, b in zip(ref, got, strict=True):
        _same(a, b)
    assert all(len(d.tokens) > 0 for d in got)


def test_state_bytes_are_what_the_rows_allocate() -> None:
    """The draft model's cache rows, and the EAGLE head's cache rows with the target's features: what `rows` rows
    allocate once they draft; n-gram and Medusa rows hold no cache."""
    target = _model(4)
    eagle = new_head(target, "eagle", torch.arange(0, VOCAB, 2), seed=2)
    views = _views(0.0)
    for rows in (1, 3):
        draft = DraftModelRows(DRAFT, MAX_LEN, max_rows=rows)
        heads = EagleRows(eagle, MAX_LEN, max_rows=rows)
        for proposer in (draft, heads):
            proposer.reserve(rows)
            for key in range(rows):
                proposer.begin(key, views[key])
        assert draft.cache.cache is not None and heads.cache.cache is not None
        assert draft.state_bytes(rows) == draft.cache.cache.nbytes()
        features = sum(t.nbytes for t in heads.features.values())
        assert heads.state_bytes(rows) == heads.cache.cache.nbytes() + features
    medusa = new_head(target, "medusa", torch.arange(0, VOCAB, 2), seed=2)
    assert NgramRows().state_bytes(4) == MedusaRows(medusa).state_bytes(4) == 0
