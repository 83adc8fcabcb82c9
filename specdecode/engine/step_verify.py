"""Turn one sequence's target logits over [pending token] + draft into its output tokens.

Shared by the single-sequence decoder and the batch engine, so both verify identically.
"""

from __future__ import annotations

import torch

from specdecode.engine.sequence import Sequence
from specdecode.proposers.base import Draft
from specdecode.sampling import block_output_counts, draw_uniforms, logits_to_probs, sample_from_probs
from specdecode.verify import verify_chain, verify_greedy


def target_probs_for(seq: Sequence, logits: torch.Tensor, draft_tokens: list[int]) -> torch.Tensor:
    """Processed target distribution per position; logits [k+1, V] -> probs [k+1, V]."""
    counts = None
    if seq.output_counts is not None:
        # Position i is conditioned on the draft tokens before it, as output.
        counts = block_output_counts(seq.output_counts, torch.tensor(draft_tokens, dtype=torch.long))
    return logits_to_probs(logits, seq.params, counts, seq.prompt_mask)


def sample_rows(seq: Sequence, logits: torch.Tensor, draft_tokens: list[int]) -> list[int]:
    """The target's own choice at each row (argmax when greedy), as plain decoding would make it."""
    params = seq.params
    if params.greedy and not params.has_penalties:
        return logits.argmax(-1).tolist()
    probs = target_probs_for(seq, logits, draft_tokens)
    if params.greedy:
        return probs.argmax(-1).tolist()
    return sample_from_probs(probs, draw_uniforms(probs.shape[0], seq.generator)).tolist()


def verify_draft(seq: Sequence, logits: torch.Tensor, draft: Draft) -> tuple[list[int], int]:
    """logits [k+1, V] of the target over [pending] + draft -> (output tokens, number accepted)."""
    draft_t = torch.tensor(draft.tokens, dtype=torch.long)
    if seq.params.greedy:
        argmax = torch.tensor(sample_rows(seq, logits, draft.tokens))
        out, accepted = verify_greedy(draft_t, argmax)
    else:
        target_probs = target_probs_for(seq, logits, draft.tokens).cpu()
        u = draw_uniforms(len(draft) + 1, seq.generator)
        out, accepted = verify_chain(draft_t, draft.probs, target_probs, u[:-1], float(u[-1]))
    return out.tolist(), accepted
