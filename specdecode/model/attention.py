"""Attention outside the native kernels' decoder ops, and the constants that pick a path: the sliding-window mask,
`row_attention` (each query over the slots it sees, in torch) and `small_attention` (a few queries batched, for
CUDA). `Attention` in transformer.py prefers `native_kernels.attend` on the CPU, at every length."""

from __future__ import annotations

import torch

from specdecode.model.kv_cache import KVCache


def sliding_window_mask(
    cache: KVCache,
    positions: torch.Tensor,  # [B, T]
    kv_len: int,
    mask: torch.Tensor | None,  # [B, 1, T, S] or None: every slot up to kv_len
    window: int,
) -> torch.Tensor | None:
    """`mask` limited to the keys whose rope position is within `window` of the query's (HF's
    kv_pos > q_pos - window): positions, not slots, because a tree's nodes sit in slots past their
    positions. None (= `mask`) while no query is `window` positions in."""
    if int(positions.max()) < window:
        return mask
    key_pos = cache.pos[:, :kv_len]  # [B, S]
    near = (key_pos.unsqueeze(1) > positions.unsqueeze(-1) - window).unsqueeze(1)  # [B, 1, T, S]
    return near if mask is None else near & mask


SMALL_ATTENTION_TOKENS = 16
"""Off the CPU (CUDA): queries per forward up to which attention uses `small_attention` (decode and verify
steps). CPU forwards attend query by query instead (`native_kernels.attend`, `row_attention`)."""


def small_attention(
    q: torch.Tensor,  # [B, H, T, hd]
    keys: torch.Tensor,  # [B, kvh, S, hd]
    values: torch.Tensor,  # [B, kvh, S, hd]
    mask: torch.Tensor | None,  # [B, 1, T, S] bool
    scale: float | None = None,  # default head_dim ** -0.5
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for a few queries as two fp32 batched matmuls, grouping the query heads that share a
    KV head. The CPU flash-attention kernel costs ~0.3 ms per call for one query (8 ms per token on a
    28-layer model); this costs a few microseconds plus the K/V read."""
    b, h, t, hd = q.shape
    kvh, s = keys.shape[1], keys.shape[2]
    g = h // kvh
    qg = q.reshape(b, kvh, g * t, hd).float()  # head i uses KV head i // g, as in HF's repeat_kv
    scores = qg @ keys.float().transpose(-1, -2) * (hd**-0.5 if scale is None else scale)  # [B, kvh, g*T, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        m = mask.expand(b, 1, t, s).unsqueeze(2).expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
        scores = scores.masked_fill(~m, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.float()  # [B, kvh, g*T, hd]
    return out.reshape(b, h, t, hd).to(q.dtype)


EXACT_ATTENTION_TOKENS = 65
"""Queries per forward of a decode or verification step (a chain, or a tree of up to 64 nodes plus its root): up
to this many, a bf16 forward with our kernels runs its layers in one native call (`native_stack`). Attention
itself takes our kernel (`native_kernels.attend`, bf16 or fp32) at every length, each query over only the slots
it sees in slot order, so a token's bits do not depend on the forward it is in. Without the kernel (a head size it
does not take, soft-capping, no AVX512), a CPU forward of up to this many queries attends in `row_attention` (the
same property), longer ones in SDPA (not row-independent; `Transformer.make_batch_invariant` extends
`row_attention` to every length); on CUDA, `small_attention` up to 16 queries, then SDPA (neither bit-exact
against single decodes)."""


def row_attention(
    q: torch.Tensor,  # [B, H, T, hd]
    keys: torch.Tensor,  # [B, kvh, S, hd]
    values: torch.Tensor,  # [B, kvh, S, hd]
    mask: torch.Tensor | None,  # [B, 1, T, S] bool; None: every slot
    scale: float | None = None,  # default head_dim ** -0.5
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each query over only the slots it sees, gathered in slot order, in fp32. A verified
    token's row then makes the same operations on the same values as the single-token decode of that
    token would (its cache holds the same keys, contiguous after compaction), so its logits have the same
    bits: a softmax over a longer row of masked slots, or a kernel picked by the number of queries, would
    round differently and could flip a greedy near-tie (seen on bf16 Spec-Bench answers)."""
    b, h, t, hd = q.shape
    kvh, s = keys.shape[1], keys.shape[2]
    g = h // kvh
    out = torch.empty(b, h, t, hd, dtype=q.dtype, device=q.device)
    every = torch.arange(s, device=q.device)
    for i in range(b):
        for j in range(t):
            idx = every if mask is None else mask[i, 0, j].nonzero().squeeze(-1)
            k = keys[i].index_select(1, idx).float()  # [kvh, S', hd], contiguous
            v = values[i].index_select(1, idx).float()
            qg = q[i, :, j].float().reshape(kvh, g, hd).contiguous()  # head i uses KV head i // g, as in HF
            scores = torch.bmm(qg, k.transpose(1, 2)) * (hd**-0.5 if scale is None else scale)  # [kvh, g, S']
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[i, :, j] = torch.bmm(torch.softmax(scores, dim=-1), v).reshape(h, hd).to(q.dtype)
    return out
