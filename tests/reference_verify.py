"""Chain rejection sampling (speculative sampling) and its greedy fast path: the chain verifiers the tree
verifiers are checked against (tests/test_tree_verify.py), and the rule the chain losslessness test simulates
(tests/test_lossless_stats.py). The engine verifies every draft, chains included, with `specdecode.verify.tree`.

Pure functions: all randomness comes in as uniforms, so tests pick them by hand. A draft without probabilities
(n-gram, greedy draft model) is a point mass q(x)=1 on the proposed token.

Acceptance rule, written as a product to avoid dividing by zero:
    accept draft token x at position i  iff  u_i * draft_probs[i, x] < target_probs[i, x]
which is u_i < min(1, target_probs[i, x] / draft_probs[i, x]) for u_i in [0, 1). Consequences:
- target_probs[i, x] == 0 always rejects (0 < 0 is false, even for u_i == 0);
- draft_probs[i, x] == 0 with target_probs[i, x] > 0 accepts (the ratio is +inf);
- a point-mass draft accepts iff u_i < target_probs[i, x].
"""

from __future__ import annotations

import torch

from specdecode.sampling import sample_from_probs


def _recovered_distribution(
    target_row: torch.Tensor, draft_row: torch.Tensor | None, draft_token: torch.Tensor
) -> torch.Tensor:
    """Unnormalised distribution of the recovered token after rejecting `draft_token`. [V] -> [V].

    Stochastic draft: max(target_probs - draft_probs, 0). Point mass: target_probs with the rejected
    token zeroed (the same formula with q = one-hot). If the residual has no mass, which only float
    error can cause, fall back to target_probs.
    """
    if draft_row is None:
        residual = target_row.index_fill(0, draft_token.reshape(1), 0.0)  # [V]
    else:
        residual = (target_row - draft_row).clamp_min(0.0)  # [V]
    if residual.sum().item() <= 0.0:
        return target_row
    return residual


def verify_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniform: float | torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Verify a chain of k draft tokens against the target; lossless w.r.t. target_probs.

    draft_tokens: LongTensor [k]; draft_probs: [k, V] (the processed distributions the draft tokens
    were sampled from) or None for a point-mass draft; target_probs: [k+1, V] processed target
    distributions (row i conditioned on the draft tokens before i); accept_uniforms: [k] in [0, 1);
    sample_uniform: one uniform in [0, 1) for the recovered or bonus token.

    Returns (output_tokens [a+1], a): the a accepted draft tokens followed by the recovered token
    (first rejection at position a) or the bonus token sampled from target_probs[k] (a == k).
    """
    k = int(draft_tokens.shape[0])
    if target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs needs k+1={k + 1} rows for {k} draft tokens, got {target_probs.shape[0]}"
        )
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs needs k={k} rows, got {draft_probs.shape[0]}")

    draft_tokens = draft_tokens.to(device=target_probs.device, dtype=torch.long)  # no-op if already
    num_accepted = 0
    if k:
        index = draft_tokens.reshape(k, 1)
        # Scalars in Python floats (float64, exact for float32 probs): the loop is over k <= ~16 positions.
        target_at = target_probs[:k].gather(1, index).view(k).tolist()
        draft_at = [1.0] * k if draft_probs is None else draft_probs.gather(1, index).view(k).tolist()
        for u, draft_p, target_p in zip(accept_uniforms.tolist(), draft_at, target_at, strict=True):
            if not u * draft_p < target_p:  # first rejection; target_p == 0 always lands here
                break
            num_accepted += 1

    if num_accepted == k:
        dist = target_probs[k]  # bonus token (or the only token of an empty draft)
    else:
        dist = _recovered_distribution(
            target_probs[num_accepted],
            None if draft_probs is None else draft_probs[num_accepted],
            draft_tokens[num_accepted],
        )
    token = sample_from_probs(dist, sample_uniform).reshape(1)  # [1]
    if num_accepted == 0:
        return token, 0
    return torch.cat([draft_tokens[:num_accepted], token]), num_accepted  # [a+1]


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Greedy fast path: keep the longest prefix where the draft equals the target's argmax.

    draft_tokens: LongTensor [k]; target_argmax: LongTensor [k+1]. Returns (output_tokens [a+1], a);
    the output is target_argmax[:a+1] since accepted draft tokens equal the target's choice.
    Equals verify_chain with a point-mass draft and one-hot (temperature 0) target probs.
    """
    k = int(draft_tokens.shape[0])
    if target_argmax.shape[0] != k + 1:
        raise ValueError(
            f"target_argmax needs k+1={k + 1} entries for {k} draft tokens, got {target_argmax.shape[0]}"
        )
    matches = (draft_tokens.to(target_argmax.device) == target_argmax[:k]).long()  # [k]
    num_accepted = int(matches.cumprod(0).sum())
    return target_argmax[: num_accepted + 1].clone(), num_accepted
