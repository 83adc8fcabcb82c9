"""Verification of a batch step, pure: the target's logits over every row's tree in, each row's output
tokens and accepted path out (the randomness comes from each sequence's own generator).

A chain is a tree with one branch, so chains and trees, greedy and sampled, take the same path here:
greedy rows without penalties take the target's argmax (one call for the whole batch); the others
turn their logits into processed probabilities (every `SamplingParams` processor) and run multi-candidate
rejection sampling (`verify_tree`), which on a chain is exactly speculative sampling.

Each row is verified on its own: a row whose verification raises, or whose target logits are NaN at the tokens
it would emit, fails alone (engine/row_faults.py), and so does one whose first token or whose tokens'
bookkeeping (grammar, detokenizer) raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdecode.engine.constrain import mask_logits
from specdecode.engine.logprobs import TokenLogprob, mask_early_stops, path_logprobs, token_logprobs
from specdecode.engine.plan import RowTree, StepPlan
from specdecode.engine.row_faults import fail_row, guarded
from specdecode.engine.sequence import Sequence
from specdecode.sampling import draw_uniforms, logits_to_probs, sample_from_probs, tree_output_counts
from specdecode.verify import verify_tree, verify_tree_greedy


@dataclass
class Verified:
    tokens: list[int]
    """The accepted draft tokens and the target's own next token (recovered or bonus)."""
    nodes: list[int]
    """Accepted node indices in path order (root excluded)."""
    depth: int
    """Positions the row offered: its tree's longest path."""
    logprobs: list[TokenLogprob] | None = None
    """One per token when the request asks for logprobs."""


def sample_first(seq: Sequence, last_logits: torch.Tensor) -> int:
    """The first output token from the logits [1, V] at the prompt's last position, as plain decoding."""
    params = seq.params
    if params.raw_argmax:
        return int(last_logits[0].argmax())
    probs = logits_to_probs(last_logits, params, seq.output_counts, seq.prompt_mask)
    if params.greedy:
        return int(probs[0].argmax())
    return int(sample_from_probs(probs, draw_uniforms(1, seq.generator))[0])


NAN_LOGITS = "the target's logits are NaN"


def nan_rows(logits: torch.Tensor, offsets: list[int], verdicts: list[Verified]) -> list[int]:
    """The rows whose tokens were chosen at NaN logits (logits [N, V] over every row's nodes, row i's from
    offsets[i]): NaN logits make the argmax the NaN and a sample an id past the vocabulary. One look-up for
    the whole batch, at the chosen tokens only."""
    vocab = logits.shape[-1]
    bad = {i for i, v in enumerate(verdicts) if any(not 0 <= t < vocab for t in v.tokens)}
    at, tokens, owner = [], [], []
    for i, v in enumerate(verdicts):
        if i not in bad:  # token j was chosen at node path[j]: the root, then the accepted nodes
            for node, t in zip([0, *v.nodes], v.tokens, strict=False):
                at.append(offsets[i] + node)
                tokens.append(t)
                owner.append(i)
    if at:
        bad |= {owner[j] for j, nan in enumerate(torch.isnan(logits[at, tokens]).tolist()) if nan}
    return sorted(bad)


def start_sequence(seq: Sequence, last_logits: torch.Tensor, started: float) -> None:
    """After the prompt's forward: emit the first token and record the prefill (`started`: perf_counter
    when it began, which is also when the request's own timing starts); a request whose first token fails
    finishes with an error."""
    guarded(seq, "its first token", _start, seq, last_logits, started)


def _start(seq: Sequence, last_logits: torch.Tensor, started: float) -> None:
    if seq.matcher is not None:  # the grammar first, so the first token and its logprobs see the constrained target
        last_logits = mask_logits(last_logits, [0, 1], [seq.matcher.allowed()[None]])
    last_logits = mask_early_stops(last_logits, seq.params, seq.eos_token_id, 0, torch.zeros(1, dtype=torch.long))
    first = sample_first(seq, last_logits)
    if nan_rows(last_logits, [0], [Verified([first], [], 0)]):
        raise FloatingPointError(NAN_LOGITS)
    seq.start_time = started
    seq.prefill_seconds = time.perf_counter() - started
    seq.stats.observe(0, 0, 1, 0.0, seq.prefill_seconds)
    logprob = None
    if seq.params.logprobs is not None:
        logprob = token_logprobs(last_logits, seq.params, [first], seq.output_counts, seq.prompt_mask)[0]
    seq.append(first, logprob)


def verify_row(seq: Sequence, row: RowTree, plan: StepPlan, i: int, logits: torch.Tensor,
               argmax: torch.Tensor | None) -> Verified:
    """Row i of the plan; logits [n, V] over its nodes; argmax [n] when the row is greedy without penalties."""
    tree = plan.trees[i]
    tokens = torch.tensor(row.tokens)
    params = seq.params
    if argmax is not None:
        nodes, out = verify_tree_greedy(tokens, tree, argmax)
        return Verified(out.tolist(), list(nodes), tree.max_depth,
                        path_logprobs(logits, params, None, list(nodes), out.tolist(), seq.prompt_mask))
    logits = mask_early_stops(logits, params, seq.eos_token_id, seq.num_output, tree.depth)
    counts = None if seq.output_counts is None else tree_output_counts(seq.output_counts, tree.attn_mask, tokens)
    target_probs = logits_to_probs(logits, params, counts, seq.prompt_mask).cpu()  # [n, V]
    if params.greedy:
        nodes, out = verify_tree_greedy(tokens, tree, target_probs.argmax(-1))
    else:
        n = len(row.tokens)
        u = draw_uniforms(n, seq.generator)
        # Node c decides with u[c - 1] and the final token takes u[n - 1]: on a chain these are the
        # uniforms speculative sampling reads in the same order.
        u = torch.cat([u[-1:], u[:-1]])
        probs = None if row.draft_probs is None else row.draft_probs.cpu()
        nodes, out = verify_tree(tokens, tree, probs, target_probs, u)
    return Verified(out.tolist(), list(nodes), tree.max_depth,
                    path_logprobs(logits, params, counts, list(nodes), out.tolist(), seq.prompt_mask))


def verify_rows(seqs: list[Sequence], rows: list[RowTree], plan: StepPlan, logits: torch.Tensor,
                masks: list[torch.Tensor | None] | None = None) -> list[Verified]:
    """logits [N, V] over the plan's real nodes (plan.offsets) -> every row's verdict; masks: each row's
    grammar masks [n_i, V] (structured outputs) or None. The masks apply first: the argmax, every processor,
    the rejection sampling and the logprobs all see the constrained target distribution. A row that failed
    earlier in the step, or fails here, gets an empty verdict."""
    if masks is not None:
        logits = mask_logits(logits, plan.offsets, masks)
    fast = [s.params.raw_argmax for s in seqs]
    argmax = logits.argmax(-1).cpu() if any(fast) else None  # one call for every greedy row
    out = []
    for i, (seq, row) in enumerate(zip(seqs, rows, strict=True)):
        lo, hi = plan.offsets[i], plan.offsets[i + 1]
        verdict = None if seq.finished else guarded(seq, "sampling", verify_row, seq, row, plan, i, logits[lo:hi],
                                                    argmax[lo:hi] if fast[i] else None)
        out.append(Verified([], [], 0) if verdict is None else verdict)
    for i in nan_rows(logits, plan.offsets, out):
        fail_row(seqs[i], "sampling", FloatingPointError(NAN_LOGITS))
        out[i] = Verified([], [], 0)
    return out


def append_verified(seq: Sequence, v: Verified) -> int:
    """Append the verdict's tokens up to a stop; returns how many went in. A request whose tokens' bookkeeping
    raises (its grammar, the detokenizer) fails alone."""
    emitted = 0
    try:
        for j, tok in enumerate(v.tokens):
            if seq.finished:
                break
            seq.append(tok, None if v.logprobs is None else v.logprobs[j])
            emitted += 1
    except Exception as exc:
        fail_row(seq, "its tokens' bookkeeping", exc)
    return emitted
