"""The head networks. Both read the target's final-norm hidden states ("features") and share the
target's input embeddings and output rows, which are frozen and never saved with the head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.heads.config import HeadConfig, check_feature_layers
from specdecode.model.kv_cache import KVCache
from specdecode.model.transformer import DecoderLayer, RMSNorm, Transformer, attention_inputs, rope_tables


class IncompatibleHeadError(ValueError):
    """A head trained for another target, or a file that is not a head."""


class DraftHead(nn.Module):
    """What EAGLE and Medusa heads share: the draft vocabulary (`d2t`: draft row -> target id) and an
    output matrix made of the target's rows for those ids."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.config = cfg
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, dtype=torch.long))
        # Follows .to(dtype/device) like the weights, whatever format the linears are converted to.
        self.register_buffer("_anchor", torch.zeros(()), persistent=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.target_vocab_size = 0
        # The target's decoder body, for its embeddings (in a list: not a submodule of the head). Looked up at
        # each call, so the copy a quantizing conversion makes of the table is followed (a stored tensor would
        # keep the old one, and with it the whole weights file, in memory).
        self._target_body: list[nn.Module] = []

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor.dtype

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    def attach(self, target: Transformer) -> DraftHead:
        """Bind to the target: check it is the model we were trained for, borrow its embeddings and
        copy its output rows for the draft vocabulary. Call before the target's linears are converted."""
        from specdecode.heads.fingerprint import target_fingerprint

        mine, theirs = self.config.target, target_fingerprint(target)
        if mine != theirs:
            raise IncompatibleHeadError(
                f"this {self.config.kind} head was trained for target {mine} but the target is {theirs}; "
                "train a head for this model with `specdecode train-head`"
            )
        weight = getattr(target.lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise RuntimeError("attach the head before converting the target's linears (needs its output matrix)")
        d2t = self.d2t.to(weight.device)
        self.lm_head.weight = nn.Parameter(weight.detach()[d2t].to(self.dtype).clone(), requires_grad=False)
        self._target_body = [target.model]
        self.target_vocab_size = target.config.vocab_size
        return self

    def saved_state(self) -> dict[str, torch.Tensor]:
        """Everything but the borrowed output rows (they are rebuilt from the target at load)."""
        return {k: v for k, v in self.state_dict().items() if k != "lm_head.weight"}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self._target_body, "attach() the head to its target first"
        with torch.no_grad():  # the target's table is frozen: no gradient flows into it
            return self._target_body[0].embed_tokens(tokens)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> fp32 logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(hidden).float()

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> fp32 logits over the target's ids [..., V]; -inf outside the draft vocabulary."""
        small = self.draft_logits(hidden)
        out = small.new_full((*small.shape[:-1], self.target_vocab_size), float("-inf"))
        out[..., self.d2t] = small
        return out


class EagleHead(DraftHead):
    """EAGLE: one decoder layer that maps (feature at position j, token at j+1) to the target's feature
    at j+1, run autoregressively on its own predictions while drafting."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        # EAGLE-3 style: the target's low/middle/high residual streams [.., k * D] -> the head's input feature.
        self.fuse = nn.Linear(len(cfg.feature_layers) * d, d, bias=False) if cfg.feature_layers else None
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.layer = DecoderLayer(cfg.layer_config(), 0)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach(self, target: Transformer) -> EagleHead:
        super().attach(target)
        if self.config.feature_layers:
            try:
                check_feature_layers(self.config.feature_layers, target.config.num_layers)
            except ValueError as e:
                raise IncompatibleHeadError(f"this head's {e}") from None
        return self

    def input_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """What the target hands over [..., D] (final-norm) or [..., k * D] (captured layers) -> the feature the
        head pairs with the next token [..., D]."""
        return target_features if self.fuse is None else self.fuse(target_features)

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def _rope_for(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < n or self._rope[0].device != self.device:
            self._rope = rope_tables(self.config.layer_config(), max(n, 256), self.device)
        return self._rope

    def forward(
        self,
        features: torch.Tensor,  # [B, T, D] target (or predicted) features at pair positions j
        tokens: torch.Tensor,  # [B, T] the token at j + 1
        positions: torch.Tensor,  # [B, T] pair index j (rope position)
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted features at j + 1 [B, T, D]. Without a cache: whole causal sequences (training)."""
        x = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], dim=-1))
        if cache is None:
            # The keys are this call's own: causal over local indices, rope at the given positions.
            t = tokens.shape[1]
            local = positions - positions[:, :1]
            cos, sin, kv_len, mask, write = attention_inputs(
                self._rope_for(int(positions.max()) + 1), x.dtype, positions, t, local, None
            )
        else:
            cos, sin, kv_len, mask, write = attention_inputs(
                self._rope_for(cache.max_len), x.dtype, positions, cache.max_len, slots, attn_mask
            )
        x = self.layer(x, cos, sin, cache, write, kv_len, mask)
        return self.norm(x)


class ResBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head k first guesses the next token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(DraftHead):
    """Medusa: K residual blocks on the target's last feature; block k guesses the token k + 1 places
    after the target's own next token, through the (shared) output rows."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(ResBlock(cfg.hidden_size) for _ in range(cfg.num_medusa_heads))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [K, ..., D] one feature per head."""
        return torch.stack([block(features) for block in self.blocks])


def build_head(cfg: HeadConfig) -> DraftHead:
    if cfg.kind == "eagle":
        return EagleHead(cfg)
    if cfg.kind == "medusa":
        return MedusaHeads(cfg)
    raise IncompatibleHeadError(f"unknown head kind {cfg.kind!r}; expected eagle or medusa")
