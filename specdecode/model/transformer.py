"""Our Llama-family decoder in plain PyTorch (gpt-fast style): Llama 1-3, Mistral, Qwen2/3, Phi-3, Gemma 2.

Module names follow Hugging Face's state-dict keys so safetensors load without renaming.
The forward takes explicit rope positions, explicit cache slots and an optional
explicit attention mask: trees pass both, chains rely on the default causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.model import native_kernels, native_stack, rope
from specdecode.model.attention import (
    EXACT_ATTENTION_TOKENS,
    SMALL_ATTENTION_TOKENS,
    row_attention,
    sliding_window_mask,
    small_attention,
)
from specdecode.model.config import ModelConfig
from specdecode.model.kv_cache import CacheSlots, KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        """Gemma: the weight is an offset, x * (1 + weight) in fp32, as its reference computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if native_kernels.glue_applies(x) and self.weight.dtype == torch.bfloat16:
            return native_kernels.rms_norm(x, self.weight, self.eps)  # ~40 us -> ~2 us a norm on 2 cores
        # fp32 statistics, as the reference implementation does; torch's fused kernel gives its result bit
        # for bit in one op instead of five (~1 ms a token over 57 norms).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [max_len, head_dim] in fp32 (HF rotate_half layout): the first half of
    sin is negated, so that rotate_half(x) * sin == x.roll(head_dim / 2) * (the table), bit for bit."""
    inv_freq = rope.inv_freq(cfg, device)  # RoPE scaling changes only these: the native kernels read the tables
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    half = cfg.head_dim // 2
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd]; cos and sign-folded sin (`rope_tables`) [B, 1, T, hd]. One roll instead of
    slices, a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def attention_inputs(
    rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin tables [S, hd]
    dtype: torch.dtype,
    positions: torch.Tensor,  # [B, T]
    cache_len: int,
    slots: torch.Tensor | None,  # [B, T] or None = positions
    attn_mask: torch.Tensor | None,  # [B, T, S] or None = causal over slots
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None, CacheSlots]:
    """Rope cos/sin at the positions [B, 1, T, hd], the attended cache length, the [B, 1, T, S] mask
    (None when one query sees everything) and the slots. Shared by the target and the draft heads."""
    if slots is None:
        slots = positions
    b, t = positions.shape
    write = CacheSlots.of(slots)
    if attn_mask is None:
        kv_len = write.end
        if b == 1 and t == 1:
            mask = None  # one query sees every slot up to its own
        else:
            mask = torch.arange(kv_len, device=positions.device).view(1, 1, kv_len) <= slots.unsqueeze(-1)
            mask = mask.unsqueeze(1)
    else:
        kv_len = attn_mask.shape[-1]
        mask = attn_mask.unsqueeze(1)
    if kv_len > cache_len:
        raise ValueError(f"cache slot {kv_len - 1} beyond the cache size {cache_len}")
    cos_t, sin_t = rope
    cos = cos_t[positions].to(dtype).unsqueeze(1)
    sin = sin_t[positions].to(dtype).unsqueeze(1)
    return cos, sin, kv_len, mask, write


class RowwiseLinear(nn.Linear):
    """A Linear applied to one row at a time, each as a single-token decode applies it. A matrix product's
    kernel (and so its rounding) depends on how many rows it multiplies; one row at a time, a token's result
    is the same whatever else the forward holds (`Transformer.make_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = torch.cat([F.linear(r, self.weight, self.bias) for r in rows.split(1)])  # [N, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.rowwise = False
        """Without our attention kernel: attend query by query at any length (batch-invariant mode), not only up
        to EXACT_ATTENTION_TOKENS."""
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=False)
        self.qkv_proj: nn.Module | None = None
        if cfg.qk_norm:  # Qwen3: each head's q and k normalised before RoPE
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = (cfg.query_pre_attn_scalar or self.hd) ** -0.5
        self.sdpa_scale = None if cfg.query_pre_attn_scalar is None else self.scale  # None: SDPA's own 1/sqrt(hd)
        self.softcap = cfg.attn_logit_softcapping
        self.native_attend = cfg.attn_logit_softcapping is None
        """Whether the native attention kernel (plain softmax at any scale) computes this layer's attention."""
        self.native_rope = not cfg.qk_norm
        """Whether `native_kernels.rope_qkv` may rope q and k straight from the projection."""

    def fuse(self) -> None:
        """Replace q/k/v by one projection: one larger matrix-vector product streams weights faster
        than three small ones (k/v are only 256 rows wide for Qwen2.5-1.5B)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features, bias=q.bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]).detach(), requires_grad=False)
        if q.bias is not None:
            fused.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]).detach(), requires_grad=False)
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.n_kv * self.hd
        return self.qkv_proj(x).split([self.n_heads * self.hd, kv, kv], dim=-1)  # type: ignore[return-value]

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,  # [B, 1, T, hd]
        sin: torch.Tensor,
        cache: KVCache | None,
        slots: CacheSlots,  # where this forward's K/V go
        kv_len: int,
        mask: torch.Tensor | None,  # [B, 1, T, kv_len] bool, True = attend
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # Our kernel, at every length: each query over the slots it sees in slot order (row-independent).
        native = (self.native_attend and cache is not None and native_kernels.attend_applies(x, self.hd)
                  and cache.k.dtype == x.dtype)
        if native and self.native_rope and self.qkv_proj is not None and x.dtype == torch.bfloat16:
            # rope, cache write and attention in two native calls
            k_layer, v_layer = cache.layer(self.layer_idx)
            q = native_kernels.rope_qkv(self.qkv_proj(x), cos, sin, slots.index, slots.end, k_layer, v_layer,
                                        self.n_heads)
            keys, values = cache.read(self.layer_idx, kv_len)
            return self.o_proj(native_kernels.attend(q, keys, values, mask, self.scale))
        q, k, v = self._project(x)
        q = q.reshape(b, t, self.n_heads, self.hd)
        k = k.reshape(b, t, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:  # training a head: whole sequences, no cache, keys are this call's own
            keys, values = k, v
        else:
            cache.write(self.layer_idx, slots, k, v)
            keys, values = cache.read(self.layer_idx, kv_len)  # [B, kvh, S, hd]
        if native:
            return self.o_proj(native_kernels.attend(q, keys, values, mask, self.scale))
        if self.rowwise or (t <= EXACT_ATTENTION_TOKENS and q.device.type == "cpu"):
            out = row_attention(q, keys, values, mask, self.scale, self.softcap)
        elif t <= SMALL_ATTENTION_TOKENS or self.softcap is not None:
            # CUDA: a Python loop over rows would cost more than the forward. SDPA has no soft-capping.
            out = small_attention(q, keys, values, mask, self.scale, self.softcap)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.sdpa_scale,
                                                 enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU; else SiLU (SwiGLU)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def fuse(self) -> None:
        """gate and up as one projection (one pass over the input, one larger product)."""
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=False, device="meta")
        fused.weight = nn.Parameter(torch.cat([g.weight, u.weight]).detach(), requires_grad=False)
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        if native_kernels.glue_applies(x) and not self.gelu:
            return self.down_proj(native_kernels.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        g = cfg.gemma_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, g)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, g)
        """Llama: the norm before the MLP. Gemma 2: the norm of the attention's output."""
        self.gemma = g
        if g:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, g)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, g)
        self.sliding = cfg.window_of(layer_idx) is not None
        """Whether this layer takes the sliding-window mask."""

    def forward(self, x, cos, sin, cache, slots, kv_len, mask):  # noqa: ANN001 - shapes as in Attention
        if self.gemma:
            h = self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, kv_len, mask)
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, kv_len, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """HF's `model.*` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._native_stack: tuple[nn.Module, nn.Module, native_stack.NativeStack | None] | None = None
        """(first and last linear, the stack or None if this model cannot take it), built at the first few-row
        forward and again when a conversion has replaced the linears."""
        self.capture_layers: tuple[int, ...] = ()
        """Layers (ascending; num_layers = after the last) whose input every forward copies into `captured`:
        the low, middle and high features a fused-feature (EAGLE-3 style) head reads."""
        self.captured: torch.Tensor | None = None
        """The last forward's residual stream entering each capture layer, concatenated [B, T, len * D]."""
        self.batch_invariant = False
        """Every token computed as if alone (`make_batch_invariant`)."""
        self.output_ids: torch.Tensor | None = None
        """The ids the output matrix has rows for, where it is cut to a draft vocabulary (`output_rows.py`)."""

    def fuse_projections(self) -> Transformer:
        """Fuse q/k/v and gate/up in every layer (after loading; state-dict names are HF's before)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def make_batch_invariant(self) -> Transformer:
        """Compute every token of a forward as if it were alone on the paths our kernels do not cover (no AVX512:
        torch's fp32 linears; attention our kernel does not take): plain nn.Linear layers row by row, attention
        query by query at any length. With our kernels (the `f32` / `bf16` formats, `native_kernels.attend`) a
        token's bits are already those of the token alone, and this changes nothing. Otherwise a token's logits
        (and K/V) then get the same bits in a decode step, a verified draft, a tree, a prompt prefilled whole or
        by chunks, or a batch of any rows, at one pass over the weights per row instead of per forward."""
        for m in self.modules():
            if type(m) is nn.Linear:
                m.__class__ = RowwiseLinear
            elif isinstance(m, Attention):
                m.rowwise = True
        self.batch_invariant = True
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim, dtype or self.dtype, self.device
        )

    def _rope_for(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < max_len or self._rope[0].device != self.device:
            self._rope = rope_tables(self.config, max(max_len, 256), self.device)
        return self._rope

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] rope positions
        cache: KVCache,
        slots: torch.Tensor | None = None,  # [B, T] cache slots; default = positions
        attn_mask: torch.Tensor | None = None,  # [B, T, S] bool over cache slots, True = attend
    ) -> torch.Tensor:
        """Run the decoder, writing K/V at `slots`; returns final-norm hidden states [B, T, D].

        Cache lengths are not changed here: the engine step owns them.
        """
        cos, sin, kv_len, mask, slots = attention_inputs(
            self._rope_for(cache.max_len), self.dtype, positions, cache.max_len, slots, attn_mask
        )
        cfg = self.config
        window_mask = mask
        if cfg.sliding_window is not None:
            cache.write_positions(slots, positions)
            window_mask = sliding_window_mask(cache, positions, kv_len, mask, cfg.sliding_window)
        x = self.model.embed_tokens(tokens)
        if cfg.gemma_norms:  # Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
        few = tokens.shape[1] <= EXACT_ATTENTION_TOKENS and not self.batch_invariant
        stack = native_stack.stack_for(self, x, cache) if few else None
        caps = self.capture_layers
        if stack is not None:  # decode / verification on CPU: every layer in one native call, same bits
            # (plain_layers: every layer has the window or none does)
            x, kept = native_stack.run(self, stack, x.contiguous(), cos, sin, slots, kv_len, window_mask, cache, caps)
        else:
            kept = []
            for i, layer in enumerate(self.model.layers):
                if i in caps:
                    kept.append(x)
                x = layer(x, cos, sin, cache, slots, kv_len, window_mask if layer.sliding else mask)
            if len(self.model.layers) in caps:
                kept.append(x)
        self.captured = torch.cat(kept, dim=-1) if caps else None
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> fp32 logits [..., V] (soft-capped in the model's dtype where the model caps them)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.output_ids is None:
            return logits.float()
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"), dtype=torch.float32)
        full[..., self.output_ids] = logits.float()  # [..., V]: -inf on the ids without a row
        return full
