"""Tree verification: golden values with hand-picked uniforms, agreement with the chain verifier,
and statistical losslessness across step boundaries (docs/design.md).

Golden probabilities are binary fractions so every comparison is exact in float32.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_verify import verify_chain, verify_greedy
from stat_helpers import P_THRESHOLD, chain_logits, chi_square_pvalue, histogram, markov_joint

from specdecode.sampling import SamplingParams, draw_uniforms, logits_to_probs, sample_from_probs
from specdecode.tree import TreeBuffers, build_tree
from specdecode.verify import tree as tree_verify
from specdecode.verify.tree import verify_tree, verify_tree_greedy

#        0            node: token
#      /   \          0: 3 (pending root)
#     1     2         1: 1   2: 2
#    / \    |         3: 0   4: 2   5: 1
#   3   4   5
TWO_LEVEL = build_tree([-1, 0, 0, 1, 1, 2])
TWO_LEVEL_TOKENS = torch.tensor([3, 1, 2, 0, 2, 1])
UNIFORM_ROW = [0.25, 0.25, 0.25, 0.25]


def _probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _u(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------
# Golden values, point-mass children
# ---------------------------------------------------------------------------------------------------


def test_first_child_rejected_second_accepted_then_zero_target_rejects() -> None:
    target_probs = _probs(
        [
            [0.125, 0.5, 0.25, 0.125],  # root: node 1 (token 1) has 0.5, node 2 (token 2) 0.25
            UNIFORM_ROW,
            [0.5, 0.0, 0.5, 0.0],  # node 2: its child node 5 has token 1, target prob 0
            UNIFORM_ROW,
            UNIFORM_ROW,
            UNIFORM_ROW,
        ]
    )
    # u[1]=0.75 >= 0.5 rejects node 1; residual [1/8, 0, 1/4, 1/8] (mass 1/2) -> node 2 accepted iff
    # u[2] < (1/4)/(1/2) = 0.5. Node 5: target prob 0 rejects even with u = 0. Final token from
    # target_probs[2] with u[0] = 0.75 -> token 2 (CDF 0.5, 0.5, 1, 1).
    uniforms = _u(0.75, 0.75, 0.4375, 0.0, 0.0, 0.0)
    accepted, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, uniforms)
    assert accepted == [2]
    assert out.tolist() == [2, 2]
    assert out.dtype == torch.long

    # Just above the residual's ratio (0.5) node 2 is rejected as well.
    uniforms = _u(0.75, 0.75, 0.5, 0.0, 0.0, 0.0)
    accepted, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, uniforms)
    assert accepted == []


def test_all_rejected_at_root_samples_the_residual() -> None:
    target_probs = _probs([[0.125, 0.5, 0.25, 0.125]] + [UNIFORM_ROW] * 5)
    # Reject node 1 (0.75 >= 0.5) and node 2 (0.6 * 0.5 >= 0.25): residual [1/8, 0, 0, 1/8].
    # u[0] = 0.5 lands on the boundary of the residual's CDF -> token 3; u[0] = 0.49 -> token 0.
    accepted, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, _u(0.5, 0.75, 0.6, 0, 0, 0))
    assert accepted == []
    assert out.tolist() == [3]
    _, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, _u(0.49, 0.75, 0.6, 0, 0, 0))
    assert out.tolist() == [0]
    # The rejected tokens are never recovered, whatever the final uniform.
    for u0 in (0.0, 0.24, 0.26, 0.5, 0.74, 0.99, 0.999999):
        _, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, _u(u0, 0.75, 0.6, 0, 0, 0))
        assert out.item() in (0, 3)


def test_full_path_accepted_plus_bonus_at_leaf() -> None:
    target_probs = _probs(
        [
            [0.125, 0.5, 0.25, 0.125],
            [0.0, 0.25, 0.25, 0.5],  # node 1: child node 3 (token 0) has prob 0, node 4 (token 2) 0.25
            UNIFORM_ROW,
            UNIFORM_ROW,
            [0.125, 0.125, 0.5, 0.25],  # node 4 is a leaf: the bonus comes from this row
            UNIFORM_ROW,
        ]
    )
    uniforms = _u(0.6, 0.1, 0.0, 0.0, 0.2, 0.0)
    accepted, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, uniforms)
    assert accepted == [1, 4]
    assert out.tolist() == [1, 2, 2]  # CDF of the leaf row: 1/8, 1/4, 3/4, 1 -> u=0.6 picks token 2
    # Same path, a bonus uniform in the last bucket.
    _, out = verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, _u(0.8, 0.1, 0.0, 0.0, 0.2, 0.0))
    assert out.tolist() == [1, 2, 3]


def test_root_only_tree_samples_target() -> None:
    tree = build_tree([-1])
    target_probs = _probs([[0.25, 0.0, 0.75, 0.0]])
    accepted, out = verify_tree(torch.tensor([1]), tree, None, target_probs, _u(0.3))
    assert (accepted, out.tolist()) == ([], [2])
    accepted, out = verify_tree(torch.tensor([1]), tree, target_probs, target_probs, _u(0.2))
    assert (accepted, out.tolist()) == ([], [0])


def test_point_mass_accepts_with_target_prob() -> None:
    star = build_tree([-1, 0])
    tokens = torch.tensor([0, 2])
    target_probs = _probs([[0.25, 0.25, 0.5, 0.0], UNIFORM_ROW])
    assert verify_tree(tokens, star, None, target_probs, _u(0.0, 0.4999))[0] == [1]
    assert verify_tree(tokens, star, None, target_probs, _u(0.0, 0.5))[0] == []


# ---------------------------------------------------------------------------------------------------
# Golden values, stochastic children (i.i.d. from draft_probs[parent])
# ---------------------------------------------------------------------------------------------------


def test_stochastic_second_sibling_uses_normalised_residual() -> None:
    star = build_tree([-1, 0, 0])
    tokens = torch.tensor([3, 1, 0])
    draft_probs = _probs([[0.375, 0.625, 0.0, 0.0], UNIFORM_ROW, UNIFORM_ROW])
    target_probs = _probs([[0.5, 0.25, 0.25, 0.0], UNIFORM_ROW, [0.0, 0.5, 0.25, 0.25]])
    # Node 1 (token 1): accept iff u < 0.25 / 0.625 = 0.4; u = 0.5 rejects. Residual max(r - q, 0) =
    # [1/8, 0, 1/4, 0], normalised [1/3, 0, 2/3, 0]. Node 2 (token 0): accept iff u < (1/3) / 0.375 = 8/9.
    # Bonus from target_probs[2] with u[0] = 0.5 -> token 2 (CDF 0, 0.5, 0.75, 1; a boundary goes up).
    accepted, out = verify_tree(tokens, star, draft_probs, target_probs, _u(0.5, 0.5, 0.88))
    assert accepted == [2]
    assert out.tolist() == [0, 2]
    accepted, out = verify_tree(tokens, star, draft_probs, target_probs, _u(0.5, 0.5, 0.9))
    assert accepted == []
    assert out.tolist() == [2]  # the residual after both rejections is [0, 0, 1/4, 0]
    # Node 1 is accepted just below its ratio; its child list is empty, so the bonus is from row 1.
    accepted, out = verify_tree(tokens, star, draft_probs, target_probs, _u(0.5, 0.3999, 0.0))
    assert (accepted, out.tolist()) == ([1], [1, 2])


def test_stochastic_draft_zero_prob_accepts_and_target_zero_rejects() -> None:
    star = build_tree([-1, 0, 0])
    draft_probs = _probs([[0.5, 0.5, 0.0, 0.0], UNIFORM_ROW, UNIFORM_ROW])
    target_probs = _probs([[0.0, 0.25, 0.5, 0.25], UNIFORM_ROW, UNIFORM_ROW])
    # Token 0: target 0 -> rejected even with u = 0. Token 2: draft 0, target > 0 -> accepted with any u.
    accepted, out = verify_tree(torch.tensor([1, 0, 2]), star, draft_probs, target_probs, _u(0.0, 0.0, 0.999))
    assert accepted == [2]
    assert out.tolist() == [2, 0]


def test_stochastic_duplicate_siblings() -> None:
    # i.i.d. children may repeat a token; after its rejection the residual below q gives it no chance.
    star = build_tree([-1, 0, 0])
    draft_probs = _probs([[0.75, 0.25, 0.0, 0.0], UNIFORM_ROW, UNIFORM_ROW])
    target_probs = _probs([[0.5, 0.5, 0.0, 0.0], UNIFORM_ROW, UNIFORM_ROW])
    accepted, out = verify_tree(torch.tensor([2, 0, 0]), star, draft_probs, target_probs, _u(0.3, 0.9, 0.0))
    assert accepted == []
    assert out.tolist() == [1]  # residual max(r - q, 0) = [0, 1/4, 0, 0]


def test_input_validation() -> None:
    target_probs = _probs([UNIFORM_ROW] * 6)
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs, _u(0.5, 0.5))
    with pytest.raises(ValueError, match="target_probs"):
        verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, None, target_probs[:5], _u(*[0.5] * 6))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_tree(TWO_LEVEL_TOKENS, TWO_LEVEL, target_probs[:3], target_probs, _u(*[0.5] * 6))
    with pytest.raises(ValueError, match="tokens"):
        verify_tree_greedy(TWO_LEVEL_TOKENS[:4], TWO_LEVEL, TWO_LEVEL_TOKENS)


# ---------------------------------------------------------------------------------------------------
# Greedy golden values
# ---------------------------------------------------------------------------------------------------


def test_greedy_follows_argmax_through_second_child() -> None:
    # Root predicts 2 -> node 2 (the second child); node 2 predicts 1 -> node 5, a leaf; bonus argmax[5].
    argmax = torch.tensor([2, 0, 1, 0, 0, 3])
    accepted, out = verify_tree_greedy(TWO_LEVEL_TOKENS, TWO_LEVEL, argmax)
    assert accepted == [2, 5]
    assert out.tolist() == [2, 1, 3]


def test_greedy_stops_at_mismatch_and_at_root() -> None:
    accepted, out = verify_tree_greedy(TWO_LEVEL_TOKENS, TWO_LEVEL, torch.tensor([1, 3, 0, 0, 0, 0]))
    assert (accepted, out.tolist()) == ([1], [1, 3])  # node 1's children have tokens 0 and 2, not 3
    accepted, out = verify_tree_greedy(TWO_LEVEL_TOKENS, TWO_LEVEL, torch.tensor([0, 0, 0, 0, 0, 0]))
    assert (accepted, out.tolist()) == ([], [0])


def test_greedy_duplicate_children_take_the_first() -> None:
    star = build_tree([-1, 0, 0, 1, 2])
    accepted, out = verify_tree_greedy(torch.tensor([0, 1, 1, 2, 3]), star, torch.tensor([1, 3, 3, 0, 0]))
    assert (accepted, out.tolist()) == ([1], [1, 3])


# ---------------------------------------------------------------------------------------------------
# Properties: agreement with the chain verifier, greedy vs sampling, structural invariants
# ---------------------------------------------------------------------------------------------------

UNIFORMS = st.one_of(
    st.floats(0.0, 1.0, exclude_max=True), st.sampled_from([0.0, 0.125, 0.25, 0.5, 0.75, 1.0 - 2.0**-53])
)


@st.composite
def prob_rows(draw: st.DrawFn, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 distributions with ties and exact zeros (integer weights)."""
    weights = [
        draw(st.lists(st.integers(0, 8), min_size=vocab, max_size=vocab).filter(lambda w: sum(w) > 0))
        for _ in range(rows)
    ]
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum(-1, keepdim=True)  # [rows, vocab]


@st.composite
def chain_cases(draw: st.DrawFn) -> tuple:
    vocab = draw(st.integers(2, 6))
    k = draw(st.integers(0, 5))
    tokens = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=k + 1, max_size=k + 1)))
    target_probs = draw(prob_rows(k + 1, vocab))
    draft_probs = draw(st.one_of(st.none(), prob_rows(k + 1, vocab)))
    uniforms = torch.tensor(draw(st.lists(UNIFORMS, min_size=k + 1, max_size=k + 1)), dtype=torch.float64)
    return tokens, draft_probs, target_probs, uniforms


@settings(max_examples=300, deadline=None)
@given(chain_cases())
def test_chain_tree_equals_verify_chain(case: tuple) -> None:
    tokens, draft_probs, target_probs, uniforms = case  # tokens[0] is the root; draft rows [k+1, V]
    k = tokens.shape[0] - 1
    chain = build_tree([-1, *range(k)])
    chain_draft = None if draft_probs is None else draft_probs[:k]  # row i: law of draft token i
    expected, num_accepted = verify_chain(tokens[1:], chain_draft, target_probs, uniforms[1:], uniforms[0].item())
    accepted, out = verify_tree(tokens, chain, draft_probs, target_probs, uniforms)
    assert accepted == list(range(1, num_accepted + 1))
    assert out.tolist() == expected.tolist()

    argmax = target_probs.argmax(-1)  # [k+1]
    expected, num_accepted = verify_greedy(tokens[1:], argmax)
    accepted, out = verify_tree_greedy(tokens, chain, argmax)
    assert accepted == list(range(1, num_accepted + 1))
    assert out.tolist() == expected.tolist()


@st.composite
def tree_cases(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 10))
    vocab = draw(st.integers(2, 5))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
    target_probs = draw(prob_rows(n, vocab))
    draft_probs = draw(st.one_of(st.none(), prob_rows(n, vocab)))
    uniforms = torch.tensor(draw(st.lists(UNIFORMS, min_size=n, max_size=n)), dtype=torch.float64)
    return build_tree(parents), tokens, draft_probs, target_probs, uniforms


@settings(max_examples=300, deadline=None)
@given(tree_cases())
def test_tree_invariants_and_greedy_agreement(case: tuple) -> None:
    buffers, tokens, draft_probs, target_probs, uniforms = case
    accepted, out = verify_tree(tokens, buffers, draft_probs, target_probs, uniforms)
    # The accepted nodes form a path from the root, and the output is their tokens + one more.
    last = accepted[-1] if accepted else 0
    assert buffers.path_to(last) == [0, *accepted]
    assert out.tolist()[:-1] == tokens[accepted].tolist()
    final = int(out[-1])
    assert target_probs[last, final] > 0  # never a token the target cannot produce
    if draft_probs is None and last not in buffers.leaves:
        # All of last's children were rejected: a point mass never recovers a rejected token, unless
        # the target put all its mass on them (then only float rounding could have rejected them all).
        rejected = {int(tokens[c]) for c in buffers.children[last]}
        if target_probs[last, sorted(rejected)].sum() < 1.0 - 1e-6:
            assert final not in rejected

    # Greedy = sampling with a one-hot target, for either kind of draft.
    argmax = target_probs.argmax(-1)  # [n]
    one_hot = torch.nn.functional.one_hot(argmax, target_probs.shape[1]).float()  # [n, V]
    greedy = verify_tree_greedy(tokens, buffers, argmax)
    sampled = verify_tree(tokens, buffers, draft_probs, one_hot, uniforms)
    assert greedy[0] == sampled[0]
    assert greedy[1].tolist() == sampled[1].tolist()


# ---------------------------------------------------------------------------------------------------
# Statistical losslessness: a speculative loop with a tree per step over Markov-chain models
# ---------------------------------------------------------------------------------------------------

VOCAB = 5
PROMPT_TOKEN = 0
NUM_EMITTED = 3
NUM_RUNS = 12_000
NUM_CONTROL_RUNS = 3_000  # the controls fail by a wide margin (p < 1e-200 measured), so fewer runs do
TARGET_LOGITS = chain_logits(VOCAB, seed=11, scale=1.5)
DRAFT_LOGITS = TARGET_LOGITS + chain_logits(VOCAB, seed=22, scale=1.0)  # mostly agrees with the target
FAR_DRAFT_LOGITS = chain_logits(VOCAB, seed=33, scale=2.0)  # unrelated: makes the negative control's bias big
PROMPT_MASK = torch.nn.functional.one_hot(torch.tensor(PROMPT_TOKEN), VOCAB).bool()  # [V]
# Root with 3 children; node 1 has 2 children, node 2 one, node 4 one: depth 3, 8 nodes.
STAT_TREE = build_tree([-1, 0, 0, 0, 1, 1, 2, 4])

STAT_CONFIGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=3, top_p=0.8),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5),
}
STAT_CASES = [
    ("temperature", True),
    ("temperature", False),
    ("top_k_top_p", True),
    ("top_k_top_p", False),
    ("penalties", False),
]



def _grow_tree(
    root: torch.Tensor,
    base_counts: torch.Tensor,
    tree: TreeBuffers,
    params: SamplingParams,
    point_mass: bool,
    draft_logits: torch.Tensor,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft one tree per run. root: [B]; base_counts: [B, V] output counts (root included).

    Returns (tokens [B, n], draft_probs [B, n, V], node_counts [B, n, V]); node_counts[:, v] = output
    counts after the path root..v, which the penalties of both models at node v see.
    """
    batch, n = root.shape[0], tree.num_nodes
    tokens = torch.empty(batch, n, dtype=torch.long)  # [B, n]
    tokens[:, 0] = root
    draft_probs = torch.zeros(batch, n, VOCAB)  # [B, n, V]; leaf rows stay 0 (never read)
    node_counts = torch.empty(batch, n, VOCAB, dtype=torch.long)  # [B, n, V]
    node_counts[:, 0] = base_counts
    for v in range(n):  # topological: v's token and counts are known here
        if v > 0:
            node_counts[:, v] = node_counts[:, int(tree.parent[v])] + torch.nn.functional.one_hot(tokens[:, v], VOCAB)
        kids = list(tree.children[v])
        if not kids:
            continue
        probs = logits_to_probs(draft_logits[tokens[:, v]], params, node_counts[:, v], PROMPT_MASK)  # [B, V]
        draft_probs[:, v] = probs
        if point_mass:
            # Deterministic distinct children: the draft's top-len(kids) tokens.
            tokens[:, kids] = probs.topk(len(kids), dim=-1).indices
        else:
            # i.i.d. children (with replacement), the case verify_tree's rule is exact for.
            draws = draw_uniforms(batch * len(kids), gen).view(batch, len(kids))  # [B, m]
            tokens[:, kids] = sample_from_probs(probs.unsqueeze(1).expand(batch, len(kids), VOCAB), draws)
    return tokens, draft_probs, node_counts


def simulate_tree(
    params: SamplingParams,
    point_mass: bool,
    seed: int,
    draft_logits: torch.Tensor = DRAFT_LOGITS,
    num_runs: int = NUM_RUNS,
) -> tuple[list[list[int]], int, int, int]:
    """NUM_RUNS speculative generations, one tree verify per step, until NUM_EMITTED tokens each.

    Returns (emitted sequences, accepted draft tokens, steps, steps that ended in a bonus token).
    """
    gen = torch.Generator().manual_seed(seed)
    emitted: list[list[int]] = [[] for _ in range(num_runs)]
    out_counts = torch.zeros(num_runs, VOCAB, dtype=torch.long)  # [R, V]
    last = torch.full((num_runs,), PROMPT_TOKEN, dtype=torch.long)  # [R] pending root token
    active = torch.arange(num_runs)
    accepted_total = steps = bonus_steps = 0
    leaves = set(STAT_TREE.leaves)
    while active.numel():
        batch = active.numel()
        tokens, draft_probs, node_counts = _grow_tree(
            last[active], out_counts[active], STAT_TREE, params, point_mass, draft_logits, gen
        )
        n = STAT_TREE.num_nodes
        target_probs = logits_to_probs(
            TARGET_LOGITS[tokens].reshape(-1, VOCAB), params, node_counts.reshape(-1, VOCAB), PROMPT_MASK
        ).reshape(batch, n, VOCAB)  # [B, n, V]
        uniforms = draw_uniforms(batch * n, gen).view(batch, n)  # [B, n]
        per_run = zip(
            active.tolist(),
            tokens.unbind(0),
            [None] * batch if point_mass else draft_probs.unbind(0),
            target_probs.unbind(0),
            uniforms.unbind(0),
            strict=True,
        )
        new_last = []
        for run, tokens_j, draft_j, target_j, uniforms_j in per_run:
            accepted, out = verify_tree(tokens_j, STAT_TREE, draft_j, target_j, uniforms_j)
            out_list = out.tolist()
            emitted[run].extend(out_list)
            for token in out_list:
                out_counts[run, token] += 1
            new_last.append(out_list[-1])
            accepted_total += len(accepted)
            bonus_steps += bool(accepted) and accepted[-1] in leaves
        steps += batch
        last[active] = torch.tensor(new_last)
        active = active[[len(emitted[run]) < NUM_EMITTED for run in active.tolist()]]
    return emitted, accepted_total, steps, bonus_steps


def _pvalue(emitted: list[list[int]], params: SamplingParams) -> float:
    """Chi-square p-value of the first NUM_EMITTED tokens against the exact processed target chain."""
    exact = markov_joint(TARGET_LOGITS, params, PROMPT_TOKEN, NUM_EMITTED)
    return chi_square_pvalue(histogram(emitted, VOCAB, NUM_EMITTED), exact)


@pytest.mark.parametrize(
    ("config", "point_mass"),
    STAT_CASES,
    ids=[f"{name}-{'point_mass' if pm else 'stochastic'}" for name, pm in STAT_CASES],
)
def test_tree_is_lossless(config: str, point_mass: bool) -> None:
    params = STAT_CONFIGS[config]
    emitted, accepted, steps, bonus_steps = simulate_tree(params, point_mass, seed=2000 + 7 * len(config) + point_mass)
    # The runs must exercise accepted, recovered and bonus paths, across step boundaries.
    assert 0 < accepted and 0 < bonus_steps < steps
    assert steps > NUM_RUNS  # some runs needed a second step
    pvalue = _pvalue(emitted, params)
    assert pvalue > P_THRESHOLD, f"{config}, point_mass={point_mass}: p={pvalue:.3g}"


@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass", "stochastic"])
def test_negative_control_without_residual_update_fails(monkeypatch: pytest.MonkeyPatch, point_mass: bool) -> None:
    """Keeping r = target_probs after a rejection (no residual update) must be detected."""
    monkeypatch.setattr(tree_verify, "_reject_residual", lambda residual, mass, draft_row, token: residual)
    params = STAT_CONFIGS["temperature"]
    emitted, accepted, steps, _ = simulate_tree(
        params, point_mass, seed=7, draft_logits=FAR_DRAFT_LOGITS, num_runs=NUM_CONTROL_RUNS
    )
    assert 0 < accepted < steps * (STAT_TREE.num_nodes - 1)
    pvalue = _pvalue(emitted, params)
    assert pvalue < P_THRESHOLD, f"negative control passed the test: p={pvalue:.3g}"

