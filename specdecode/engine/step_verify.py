"""Turn one sequence's target logits over [pending token] + draft into its output tokens.

Shared by the single-sequence decoder and the batch engine, so both verify identically.
"""

from __future__ import annotations

import time

import torch

from specdecode.engine.sequence import Sequence
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Draft, Proposer
from specdecode.sampling import block_output_counts, draw_uniforms, logits_to_probs, sample_from_probs
from specdecode.tree import TreeBuffers
from specdecode.verify import verify_chain, verify_greedy, verify_tree, verify_tree_greedy


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


def start_sequence(seq: Sequence, last_logits: torch.Tensor, proposer: Proposer | None, started: float) -> None:
    """After the prompt's forward: emit the first token, start the proposer, record the prefill.

    last_logits [1, V] are the target's logits at the last prompt position; `started` is when the
    prefill began (perf_counter), which is also when the request's own timing starts.
    """
    first = sample_rows(seq, last_logits, [])[0]
    if proposer is not None:
        proposer.begin(seq.view())
    seq.start_time = started
    seq.prefill_seconds = time.perf_counter() - started
    seq.stats.observe(0, 0, 1, 0.0, seq.prefill_seconds)
    seq.append(first)


def verify_draft(seq: Sequence, logits: torch.Tensor, draft: Draft) -> tuple[list[int], int]:
    """logits [k+1, V] of the target over [pending] + draft -> (output tokens, number accepted)."""
    draft_t = torch.tensor(draft.tokens, dtype=torch.long)
    if seq.params.greedy:
        argmax = torch.tensor(sample_rows(seq, logits, draft.tokens))
        out, accepted = verify_greedy(draft_t, argmax)
    else:
        # The accept loop reads scalars: both distributions go to the CPU (the draft's may be on a GPU).
        target_probs = target_probs_for(seq, logits, draft.tokens).cpu()  # [k+1, V]
        draft_probs = None if draft.probs is None else draft.probs.cpu()  # [k, V]
        u = draw_uniforms(len(draft) + 1, seq.generator)
        out, accepted = verify_chain(draft_t, draft_probs, target_probs, u[:-1], float(u[-1]))
    return out.tolist(), accepted


def tree_output_counts(base_counts: torch.Tensor, attn_mask: torch.Tensor, node_tokens: torch.Tensor) -> torch.Tensor:
    """Output counts each tree node's distribution is conditioned on: base + the tokens on the path
    from the root (excluded) to the node (included). attn_mask [n, n], node_tokens [n] -> [n, V]."""
    device = base_counts.device  # the counts live with the logits; the tree buffers on the CPU
    onehot = torch.zeros(node_tokens.shape[0], base_counts.shape[-1], device=device)  # [n, V]
    onehot[1:].scatter_(1, node_tokens[1:, None].to(device), 1)  # the root is the pending token: already counted
    # In float32 (CUDA has no integer matmul); exact, as each entry is a count below the tree's size.
    return base_counts + (attn_mask.to(device, torch.float32) @ onehot).to(base_counts.dtype)


def verify_tree_draft(
    seq: Sequence, logits: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers
) -> tuple[list[int], list[int]]:
    """logits [n, V] over the tree (node 0 = pending token) -> (output tokens, accepted node indices)."""
    params = seq.params
    counts = None
    if seq.output_counts is not None:
        counts = tree_output_counts(seq.output_counts, buffers.attn_mask, tokens)
    if params.greedy and not params.has_penalties:
        nodes, out = verify_tree_greedy(tokens, buffers, logits.argmax(-1))
    else:
        target_probs = logits_to_probs(logits, params, counts, seq.prompt_mask).cpu()  # [n, V]
        if params.greedy:
            nodes, out = verify_tree_greedy(tokens, buffers, target_probs.argmax(-1))
        else:
            u = draw_uniforms(tokens.shape[0] + 1, seq.generator)
            nodes, out = verify_tree(tokens, buffers, None, target_probs, u)
    return out.tolist(), list(nodes)


def share_hidden(proposer: Proposer | None, target: Transformer, hidden: torch.Tensor, index: tuple) -> None:
    """Head proposers (EAGLE, Medusa) read the target's features of the positions just kept: `index` picks
    them [m, .] from the forward's final-norm output hidden [B, T, D], or from the layers it captured for a
    fused-feature head (`Transformer.captured` [B, T, k * D])."""
    if getattr(proposer, "wants_target_hidden", False):
        source = hidden if target.captured is None else target.captured
        proposer.observe_hidden(source[index])  # type: ignore[union-attr]
