"""Statistical losslessness of chain speculative sampling (docs/design.md).

Two small Markov-chain "models" over a 5-token vocabulary: next-token logits are a fixed [V, V]
matrix row picked by the last token. We simulate the whole speculative loop (draft proposes k tokens
autoregressively from its own processed probs, target probs per block position through
`logits_to_probs` with penalties seeing the draft tokens before it, `verify_chain` picks the output,
repeat across step boundaries) and compare the joint distribution of the first 3 emitted tokens with
the exact one of the target chain under the same processing, by a chi-square test.

Runs are advanced in lockstep so the draft and target computations are batched torch ops; only
`verify_chain` is called per run, which is the function under test: the reference chain verifier
(tests/reference_verify.py), which the engine's tree verifier equals on a chain, uniform for uniform
(tests/test_tree_verify.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import reference_verify
import torch
from reference_verify import verify_chain
from stat_helpers import block_output_counts, chain_logits, chi_square_pvalue, markov_joint

from specdecode.sampling import (
    SamplingParams,
    draw_uniforms,
    logits_to_probs,
    sample_from_probs,
)

VOCAB = 5
PROMPT_TOKEN = 0
NUM_EMITTED = 3  # length of the joint distribution we test
NUM_RUNS = 20_000
P_THRESHOLD = 1e-3


def _chain_logits(seed: int, scale: float) -> torch.Tensor:
    return chain_logits(VOCAB, seed, scale)  # [V, V]: row = last token


# Seed and scale picked so that top-k, top-p and min-p keep different numbers of tokens per context
# (2 to 5), i.e. the filtered chains differ from each other.
TARGET_LOGITS = _chain_logits(seed=12, scale=1.0)
# A draft that mostly agrees with the target (realistic, and fewer steps per run) ...
DRAFT_LOGITS = TARGET_LOGITS + _chain_logits(seed=22, scale=0.8)
# ... and an unrelated one for the negative control, so the wrong residual is a large bias.
FAR_DRAFT_LOGITS = _chain_logits(seed=33, scale=2.0)
PROMPT_MASK = torch.nn.functional.one_hot(torch.tensor(PROMPT_TOKEN), VOCAB).bool()  # [V]

CONFIGS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(top_k=3),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.2),
    "penalties": SamplingParams(
        temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4
    ),
    "all_filters": SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.2, repetition_penalty=1.3),
}
# Each run costs one verify_chain call per step, so the grid is chosen to fit the file in about a
# minute: every config with both draft kinds at k=3 (several positions per block, so
# block_output_counts matters), and k=1 (more steps, more step boundaries) on two configs.
CASES = [(name, point_mass, 3) for name in CONFIGS for point_mass in (True, False)] + [
    ("temperature", True, 1),
    ("temperature", False, 1),
    ("all_filters", False, 1),
]



def exact_joint(params: SamplingParams) -> np.ndarray:
    """Exact probability of each sequence of NUM_EMITTED tokens under the processed target chain."""
    return markov_joint(TARGET_LOGITS, params, PROMPT_TOKEN, NUM_EMITTED)


def simulate(
    params: SamplingParams, point_mass: bool, k: int, seed: int, draft_logits: torch.Tensor = DRAFT_LOGITS
) -> tuple[np.ndarray, int, int]:
    """Histogram of the first NUM_EMITTED tokens over NUM_RUNS speculative runs.

    Returns (counts [V, V, V], accepted draft tokens, proposed draft tokens).
    """
    gen = torch.Generator().manual_seed(seed)
    # A point-mass draft proposes its greedy token under the same penalties; otherwise it samples
    # from its own processed distribution, which it reports as draft_probs.
    draft_params = dataclasses.replace(params, temperature=0.0) if point_mass else params
    emitted: list[list[int]] = [[] for _ in range(NUM_RUNS)]
    out_counts = torch.zeros(NUM_RUNS, VOCAB, dtype=torch.long)  # [R, V] output counts per run
    last = torch.full((NUM_RUNS,), PROMPT_TOKEN, dtype=torch.long)  # [R]
    active = torch.arange(NUM_RUNS)
    accepted_total = proposed_total = 0
    while active.numel():
        batch = active.numel()
        base_counts = out_counts[active]  # [B, V]
        ctx = last[active]  # [B]

        # Draft: k autoregressive proposals, each seeing the draft tokens before it.
        draft_tokens = torch.empty(batch, k, dtype=torch.long)  # [B, k]
        draft_probs = torch.empty(batch, k, VOCAB)  # [B, k, V]
        counts, prev = base_counts.clone(), ctx
        for i in range(k):
            probs = logits_to_probs(draft_logits[prev], draft_params, counts, PROMPT_MASK)  # [B, V]
            tokens = sample_from_probs(probs, draw_uniforms(batch, gen))  # [B]
            draft_tokens[:, i], draft_probs[:, i] = tokens, probs
            counts = counts + torch.nn.functional.one_hot(tokens, VOCAB)
            prev = tokens

        # Target: one "forward" over the block, position i conditioned on draft tokens < i.
        block_ctx = torch.cat([ctx.unsqueeze(1), draft_tokens], dim=1)  # [B, k+1]
        block_counts = block_output_counts(base_counts, draft_tokens)  # [B, k+1, V]
        target_probs = logits_to_probs(
            TARGET_LOGITS[block_ctx].reshape(-1, VOCAB), params, block_counts.reshape(-1, VOCAB), PROMPT_MASK
        ).reshape(batch, k + 1, VOCAB)  # [B, k+1, V]

        accept_uniforms = torch.rand(batch, k, generator=gen, dtype=torch.float64)  # [B, k]
        sample_uniforms = torch.rand(batch, generator=gen, dtype=torch.float64).tolist()
        # Unbind once: per-run tensor indexing would dominate the loop.
        per_run = zip(
            active.tolist(),
            draft_tokens.unbind(0),
            [None] * batch if point_mass else draft_probs.unbind(0),
            target_probs.unbind(0),
            accept_uniforms.unbind(0),
            sample_uniforms,
            strict=True,
        )
        step_out = []
        for run, tokens_j, draft_probs_j, target_probs_j, accept_j, sample_j in per_run:
            tokens, num_accepted = verify_chain(tokens_j, draft_probs_j, target_probs_j, accept_j, sample_j)
            out = tokens.tolist()
            assert len(out) == num_accepted + 1
            emitted[run].extend(out)
            step_out.append(out + [VOCAB] * (k - num_accepted))  # VOCAB = padding id
            accepted_total += num_accepted
        proposed_total += batch * k
        step_tokens = torch.tensor(step_out)  # [B, k+1]
        out_counts[active] += torch.nn.functional.one_hot(step_tokens, VOCAB + 1)[..., :VOCAB].sum(1)
        last[active] = torch.tensor([emitted[run][-1] for run in active.tolist()])
        active = active[[len(emitted[run]) < NUM_EMITTED for run in active.tolist()]]

    hist = np.zeros((VOCAB,) * NUM_EMITTED, dtype=np.int64)
    np.add.at(hist, tuple(np.array([seq[:NUM_EMITTED] for seq in emitted]).T), 1)
    return hist, accepted_total, proposed_total


@pytest.mark.parametrize(
    ("config", "point_mass", "k"),
    CASES,
    ids=[f"{name}-{'point_mass' if pm else 'stochastic'}-k{k}" for name, pm, k in CASES],
)
def test_chain_is_lossless(config: str, point_mass: bool, k: int) -> None:
    params = CONFIGS[config]
    hist, accepted, proposed = simulate(params, point_mass, k, seed=1000 + 10 * k + point_mass)
    # The run must exercise accepted, recovered and bonus paths, or the test proves little.
    assert 0 < accepted < proposed
    pvalue = chi_square_pvalue(hist, exact_joint(params))
    assert pvalue > P_THRESHOLD, f"{config}, point_mass={point_mass}, k={k}: p={pvalue:.3g}"


def test_negative_control_recovering_from_target_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling the recovered token from target_probs instead of the residual must be detected."""
    monkeypatch.setattr(reference_verify, "_recovered_distribution", lambda target_row, draft_row, token: target_row)
    params = CONFIGS["temperature"]
    hist, accepted, proposed = simulate(params, point_mass=False, k=3, seed=7, draft_logits=FAR_DRAFT_LOGITS)
    assert 0 < accepted < proposed
    pvalue = chi_square_pvalue(hist, exact_joint(params))
    assert pvalue < P_THRESHOLD, f"negative control passed the test: p={pvalue:.3g}"
