"""Per-token log-probabilities of a row's output, from the target's processed distribution at each kept node.

A step's output token j is drawn from the target's distribution at node path[j] (path = the root, then the
accepted nodes), so its log-probability comes from exactly that row of the target's logits, processed as plain
decoding would process it (`processed_logprobs`). Speculation changes which forward computes a position's
logits, never their value, so the numbers are those of plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import LOGPROB_FLOOR, SamplingParams, processed_logprobs, suppress_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token id, logprob) of the `SamplingParams.logprobs` most likely tokens, descending."""


def stop_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """The tokens min_tokens holds back: EOS (unless ignored) and the request's stop tokens."""
    ids = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        ids.append(eos_token_id)
    return ids


def mask_early_stops(logits: torch.Tensor, params: SamplingParams, eos_token_id: int | None, num_output: int,
                     depth: torch.Tensor) -> torch.Tensor:
    """min_tokens: -inf at the stop tokens of every node whose position comes before the minimum.

    logits [n, V] of a row's nodes; depth [n] node depths (0 = the pending token, whose distribution gives
    output token num_output + 1). Returns logits unchanged when min_tokens no longer applies."""
    if num_output >= params.min_tokens:
        return logits
    early = (depth + num_output) < params.min_tokens  # [n]
    return suppress_tokens(logits, stop_ids(params, eos_token_id), early)


def token_logprobs(logits: torch.Tensor, params: SamplingParams, tokens: list[int],
                   counts: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> list[TokenLogprob]:
    """logits [m, V]: row j is the target's (min_tokens-masked) logits that token j was drawn from; counts
    [m, V] the output counts each row is conditioned on (penalties) or None. One TokenLogprob per token."""
    lp = processed_logprobs(logits, params, counts, prompt_mask).clamp_min(LOGPROB_FLOOR).cpu()  # [m, V]
    k = min(params.logprobs or 0, lp.shape[-1])
    top_vals, top_ids = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [m, k], descending
    out = []
    for j, tok in enumerate(tokens):
        top = tuple(zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True))
        out.append(TokenLogprob(tok, float(lp[j, tok]), top))
    return out


def path_logprobs(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None, nodes: list[int],
                  tokens: list[int], prompt_mask: torch.Tensor | None) -> list[TokenLogprob] | None:
    """Logprobs of a row's output tokens (None unless the request asks): logits [n, V] and counts [n, V] (or
    None) over the row's nodes; token j comes from node path[j] (the root, then the accepted `nodes`)."""
    if params.logprobs is None:
        return None
    path = [0, *nodes]
    return token_logprobs(logits[path], params, tokens, None if counts is None else counts[path], prompt_mask)
