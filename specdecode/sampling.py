"""Sampling parameters and the one `logits -> probs` function used for draft AND target.

Rejection sampling is lossless only if the draft and the target distributions are
processed by the same rules, so every proposer and the verifier call `logits_to_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM."""

    max_tokens: int = 16
    """Maximum number of output tokens."""
    temperature: float = 1.0
    """0 means greedy (argmax after penalties)."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to >= top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p * max probability."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens seen in the prompt or the output (CTRL-style, as vLLM/HF)."""
    presence_penalty: float = 0.0
    """Subtracted from logits of tokens that appear in the output (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from logits once per occurrence in the output (OpenAI semantics)."""
    seed: int | None = None
    """Seed of the request's own random generator; None draws one."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings; the text is cut before the first one found."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra token ids that end generation (in addition to EOS)."""
    ignore_eos: bool = False
    """Keep generating after EOS (benchmarks)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (masks the target's logits)."""
    logprobs: int | None = None
    """Report each output token's log-probability and the `logprobs` most likely alternatives (0: the chosen
    token only); None reports none. From the distribution plain decoding samples from (see processed_logprobs)."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias in [-100, 100]) pairs added to the raw logits before every other processor (a dict works)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens are generated."""

    def __post_init__(self) -> None:
        # Normalise list inputs so the dataclass stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if isinstance(self.structured_outputs, dict):  # vLLM's dict form
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def raw_argmax(self) -> bool:
        """Greedy with nothing that changes the raw logits: the argmax of the raw logits is the answer."""
        return self.greedy and not self.has_penalties and not self.logit_bias and self.min_tokens == 0

    def validate(self) -> None:
        """Raise ValueError naming the bad field; called on construction."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        for token, bias in self.logit_bias:
            if token < 0 or not (-100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")


# Boundary slack for top-p: a prefix whose mass is within float noise of top_p counts as reaching it,
# so probs like [0.5, 0.3, ...] with top_p=0.8 keep two tokens whatever the rounding of the softmax.
_TOP_P_TOLERANCE = 1e-6


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply repetition, presence and frequency penalties to raw logits (out of place, vLLM order).

    logits: [N, V] float; output_counts: [N, V] or [V] int (occurrences in the output so far);
    prompt_mask: [N, V] or [V] bool (token appears in the prompt). Missing tensors mean "nothing seen".
    """
    rep = params.repetition_penalty
    if rep != 1.0:
        seen: torch.Tensor | None = None
        if output_counts is not None:
            seen = output_counts > 0
        if prompt_mask is not None:
            seen = prompt_mask if seen is None else seen | prompt_mask
        if seen is not None:
            # CTRL-style: shrink positive logits, push negative ones further down.
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalised, logits)
    if output_counts is not None:
        # OpenAI semantics: these only look at the output, never at the prompt.
        if params.frequency_penalty != 0.0:
            logits = logits - params.frequency_penalty * output_counts.to(logits.dtype)
        if params.presence_penalty != 0.0:
            logits = logits - params.presence_penalty * (output_counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Add the request's logit_bias to raw logits [N, V] (out of place); nothing to add returns the input."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, bias.expand(*logits.shape[:-1], -1))


def suppress_tokens(logits: torch.Tensor, token_ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """-inf at `token_ids` in the rows where `rows` [N] is True (min_tokens: no stop before the minimum).
    logits [N, V] -> [N, V], out of place; a row with nothing to mask is unchanged."""
    vocab = logits.shape[-1]
    token_ids = [t for t in token_ids if 0 <= t < vocab]  # a stop id outside the vocabulary is never generated
    if not token_ids or not bool(rows.any()):
        return logits
    ban = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
    ban[torch.tensor(token_ids, device=logits.device)] = True
    return logits.masked_fill(rows.to(logits.device)[:, None] & ban, float("-inf"))


def _top_p_keep_sorted(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask of the smallest prefix of descending probs whose mass reaches top_p. [N, V'] -> bool [N, V']."""
    # A token is kept iff the mass strictly before it has not yet reached top_p.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [N, V']
    keep = mass_before < top_p - _TOP_P_TOLERANCE
    keep[..., 0] = True  # the most likely token always survives
    return keep


def _min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero probs below min_p * (max prob of the row). [N, V'] -> [N, V']; the max itself always survives."""
    threshold = min_p * probs.amax(-1, keepdim=True)  # [N, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def logits_to_probs(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn raw logits into the processed sampling distribution, identically for draft and target.

    logits: [N, V] (or [V]) of any float dtype; output_counts: [N, V] or [V] int; prompt_mask: [N, V] or
    [V] bool. Returns float32 probs of the same shape as logits.

    Order (as vLLM): penalties on raw logits; greedy (temperature 0) -> one-hot at argmax (ties -> lowest
    id); otherwise temperature, top-k (exactly k tokens), top-p, min-p, renormalise. Filters that are
    disabled cost nothing. The input is never modified.
    """
    squeeze = logits.dim() == 1
    x = logits.to(torch.float32)  # [N, V]; may alias the input, so only out-of-place ops below
    if squeeze:
        x = x.unsqueeze(0)
    x = apply_logit_bias(x, params)  # before penalties, as vLLM
    if params.has_penalties:
        x = apply_penalties(x, params, output_counts, prompt_mask)

    if params.greedy:
        # torch.argmax returns the first maximal index, i.e. ties go to the lowest token id.
        probs = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)  # [N, V]
        return probs.squeeze(0) if squeeze else probs

    if params.temperature != 1.0:
        x = x / params.temperature
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0

    if top_k:
        # Work on the k survivors only: topk is already sorted, so top-p needs no full-vocab sort.
        top_vals, top_ids = torch.topk(x, top_k, dim=-1)  # [N, k], descending
        small = torch.softmax(top_vals, dim=-1)  # [N, k]
        if params.top_p < 1.0:
            small = small * _top_p_keep_sorted(small, params.top_p)
        if params.min_p > 0.0:
            small = _min_p_filter(small, params.min_p)
        if params.top_p < 1.0 or params.min_p > 0.0:
            small = small / small.sum(-1, keepdim=True)
        probs = torch.zeros_like(x).scatter_(-1, top_ids, small)  # [N, V]
    else:
        probs = torch.softmax(x, dim=-1)  # [N, V]
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # [N, V]
            keep_sorted = _top_p_keep_sorted(sorted_probs, params.top_p)
            keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)  # back to vocab order
            probs = probs * keep
        if params.min_p > 0.0:
            probs = _min_p_filter(probs, params.min_p)
        if params.top_p < 1.0 or params.min_p > 0.0:
            probs = probs / probs.sum(-1, keepdim=True)
    return probs.squeeze(0) if squeeze else probs


LOGPROB_FLOOR = -9999.0
"""Reported in place of -inf (a token the processors exclude): JSON has no infinities."""


def processed_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of the distribution plain decoding samples from, for reporting. [N, V] -> [N, V] fp32.

    Sampling: log of `logits_to_probs` (temperature, top-k, top-p, min-p; excluded tokens -inf), computed as a
    log-softmax for precision. Greedy: its one-hot carries no information, so the log-softmax of the logits
    after logit_bias and penalties (temperature 1), whose top-1 is the chosen token.
    """
    x = apply_logit_bias(logits.to(torch.float32), params)  # [N, V]
    if params.has_penalties:
        x = apply_penalties(x, params, output_counts, prompt_mask)
    if params.greedy:
        return torch.log_softmax(x, dim=-1)
    kept = logits_to_probs(logits, params, output_counts, prompt_mask) > 0  # [N, V]
    return torch.log_softmax((x / params.temperature).masked_fill(~kept, float("-inf")), dim=-1)


def tree_output_counts(base_counts: torch.Tensor, attn_mask: torch.Tensor, node_tokens: torch.Tensor) -> torch.Tensor:
    """Output counts each tree node's distribution is conditioned on: base + the tokens on the path
    from the root (excluded) to the node (included). attn_mask [n, n], node_tokens [n] -> [n, V]."""
    device = base_counts.device  # the counts live with the logits; the tree buffers on the CPU
    onehot = torch.zeros(node_tokens.shape[0], base_counts.shape[-1], device=device)  # [n, V]
    onehot[1:].scatter_(1, node_tokens[1:, None].to(device), 1)  # the root is the pending token: already counted
    # In float32 (CUDA has no integer matmul); exact, as each entry is a count below the tree's size.
    return base_counts + (attn_mask.to(device, torch.float32) @ onehot).to(base_counts.dtype)


# Largest uniform used: u * total then rounds strictly below total, so the search never runs past the
# last token with positive mass (u * total may round up to total for u just below 1).
_MAX_UNIFORM = 1.0 - 2.0**-52


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor | float) -> torch.Tensor:
    """Inverse-CDF sampling with the randomness passed in.

    probs: [..., V] non-negative, need not be normalised (each row must have positive mass);
    uniforms: [...] in [0, 1). Returns LongTensor [...] of token ids. A token with zero probability
    is never returned: searchsorted(right=True) steps over flat CDF segments, and u is clamped so that
    u * total stays strictly below total.
    """
    # float64 CDF: a float32 cumsum over ~150k ids drifts enough to bias the tail.
    cdf = probs.to(torch.float64).cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=cdf.device).clamp_max(_MAX_UNIFORM)  # [...]
    # right=True: the number of CDF entries <= u * total, i.e. the first id whose CDF exceeds it.
    return torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True).squeeze(-1)  # [...]


def draw_uniforms(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """n float64 uniforms in [0, 1) from `generator` (on the generator's device). Returns [n]."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device)
