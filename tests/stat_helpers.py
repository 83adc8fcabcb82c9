"""Shared helpers for the statistical losslessness tests (docs/design.md).

Small Markov-chain "models": next-token logits are a fixed [V, V] matrix row picked by the last token,
so the exact distribution of any short emitted sequence is a finite product. The chi-square helper
is the one of tests/test_lossless_stats.py (kept there unchanged; same cell-merging rule).
"""

from __future__ import annotations

import itertools

import numpy as np
import scipy.stats
import torch

from specdecode.sampling import SamplingParams, logits_to_probs

P_THRESHOLD = 1e-3
MIN_EXPECTED = 5.0  # chi-square cells with fewer expected counts are merged


def chain_logits(vocab: int, seed: int, scale: float) -> torch.Tensor:
    """Random Markov-chain logits [V, V]: row = last token."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=gen) * scale  # [V, V]


def markov_joint(
    logits: torch.Tensor, params: SamplingParams, prompt_token: int, num_emitted: int
) -> np.ndarray:
    """Exact probability [V]*num_emitted of each emitted sequence under the processed chain.

    Penalties see the emitted tokens as output counts and `prompt_token` as the prompt.
    """
    vocab = logits.shape[0]
    prompt_mask = torch.nn.functional.one_hot(torch.tensor(prompt_token), vocab).bool()  # [V]
    joint = np.zeros((vocab,) * num_emitted, dtype=np.float64)
    for seq in itertools.product(range(vocab), repeat=num_emitted):
        prob = 1.0
        counts = torch.zeros(vocab, dtype=torch.long)
        last = prompt_token
        for token in seq:
            probs = logits_to_probs(logits[last], params, counts, prompt_mask)  # [V]
            prob *= float(probs[token])
            if prob == 0.0:
                break
            counts[token] += 1
            last = token
        joint[seq] = prob
    return joint / joint.sum()  # float32 rows sum to 1 only up to rounding


def histogram(sequences: list[list[int]], vocab: int, num_emitted: int) -> np.ndarray:
    """Counts [V]*num_emitted of the first num_emitted tokens of each sequence."""
    hist = np.zeros((vocab,) * num_emitted, dtype=np.int64)
    np.add.at(hist, tuple(np.array([seq[:num_emitted] for seq in sequences]).T), 1)
    return hist


def chi_square_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with small expected counts are merged into one."""
    observed, probs = observed.ravel().astype(np.float64), probs.ravel()
    # A sample in a cell of exactly zero probability is an outright failure, not a statistic.
    assert observed[probs == 0].sum() == 0, "sampled a sequence the target chain cannot produce"
    expected = probs * observed.sum()
    big = expected >= MIN_EXPECTED
    obs_cells, exp_cells = list(observed[big]), list(expected[big])
    small_obs, small_exp = observed[~big].sum(), expected[~big].sum()
    if small_exp >= MIN_EXPECTED:
        obs_cells.append(small_obs)
        exp_cells.append(small_exp)
    elif small_exp > 0:
        # Too little mass for a cell of its own: fold it into the smallest big cell.
        smallest = int(np.argmin(exp_cells))
        obs_cells[smallest] += small_obs
        exp_cells[smallest] += small_exp
    return float(scipy.stats.chisquare(obs_cells, exp_cells).pvalue)


def block_output_counts(base_counts: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
    """Output counts seen by each verification position of a block of draft tokens (the batched chain
    reference for `tree_output_counts`).

    base_counts: [..., V] int counts of the output so far; block_tokens: [..., k] draft tokens.
    Returns [..., k+1, V]: row i = base_counts + occurrences of block_tokens[..., :i], because the
    target's distribution at position i is conditioned on the draft tokens before it as output.
    """
    k = block_tokens.shape[-1]
    vocab = base_counts.shape[-1]
    lead = block_tokens.shape[:-1]
    # One-hot of each draft token placed in the row *after* it, then a prefix sum over rows.
    steps = torch.zeros(*lead, k + 1, vocab, dtype=base_counts.dtype, device=base_counts.device)
    if k:
        ones = torch.ones(block_tokens.shape, dtype=base_counts.dtype, device=base_counts.device)
        index = block_tokens.to(base_counts.device, torch.long).unsqueeze(-1)  # tokens may come from the CPU
        steps[..., 1:, :].scatter_add_(-1, index, ones.unsqueeze(-1))
    return base_counts.unsqueeze(-2) + steps.cumsum(-2)  # [..., k+1, V]
