"""Public head checkpoints, converted into our head modules with their exact maths.

- EAGLE-1/2 (SafeAILab `cnets1.py`): `fc` over concat(embedding, target feature) [2D -> D, bias per config
  "bias", default on], then `num_hidden_layers` (must be 1) Llama decoder layer(s) whose first has NO input
  RMSNorm; the output is both the next feature and, through the target's own `lm_head` with no norm, the
  logits. The feature is the target's final-norm hidden state.
- EAGLE-3 (SafeAILab `cnets.py`): `fc` [3D -> D, no bias] fuses the target's residual stream entering layers
  2, L//2 and L-3 (or `eagle_config.eagle_aux_hidden_state_layer_ids`); `midlayer` attends over
  concat(input_layernorm(embedding), hidden_norm(h)) (q/k/v take 2D), residual h, then the usual MLP block.
  Its output h' is the next feature; logits = its own `lm_head`(norm(h')) over the draft vocabulary, draft row i
  being target id i + d2t[i]. The decoder layer may be named `layers.0.*` (vLLM / speculators) instead.
- Medusa (FasterDecoding): head i = Sequential(ResBlock x medusa_num_layers, Linear(D, V, no bias)), ResBlock
  x + SiLU(linear(x)), on the target's final-norm hidden state; keys `{i}.{j}.linear.weight/bias` and
  `{i}.{num_layers}.weight`, bare (`medusa_lm_head.pt`) or prefixed (`medusa_head.`, `medusa_lm_head.`).

Each is validated against the target (hidden size, vocabulary, layer count); anything we cannot map exactly
(rope scaling, several EAGLE layers, an activation other than SiLU, a draft width other than the target's) is
refused with an error naming the value, never loaded approximately.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdecode.heads.config import HeadConfig, check_feature_layers
from specdecode.heads.modules import DraftHead, EagleHead, IncompatibleHeadError, MedusaHeads, ResBlock
from specdecode.model.kv_cache import KVCache
from specdecode.model.transformer import RMSNorm, Transformer, attention_inputs

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt",
                "medusa_lm_head.bin")
_MEDUSA_PREFIXES = ("medusa_lm_head.", "medusa_head.", "medusa_heads.", "")


def is_public_head_dir(path: Path) -> bool:
    """A directory holding a public head checkpoint rather than one of ours (config.json + head.safetensors)."""
    return path.is_dir() and not (path / "head.safetensors").exists() and (
        any((path / f).exists() for f in WEIGHT_FILES) or any(path.glob("*.safetensors")))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [path / f for f in WEIGHT_FILES if (path / f).exists()]
    files += sorted(p for p in path.glob("*.safetensors") if p not in files)
    if not files:
        raise IncompatibleHeadError(f"{path} holds no head weights (expected one of {', '.join(WEIGHT_FILES)})")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            part = load_file(str(f))
        else:
            part = torch.load(str(f), map_location="cpu", weights_only=True)
            if not isinstance(part, dict):
                raise IncompatibleHeadError(f"{f} is not a state dict")
        # Rope tables some older checkpoints saved: recomputed from the config, as EAGLE's own code does.
        state.update({k: v for k, v in part.items()
                      if isinstance(v, torch.Tensor) and not k.endswith("rotary_emb.inv_freq")})
    return state


def _read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    return json.loads(f.read_text()) if f.exists() else {}


def detect_layout(state: dict[str, torch.Tensor]) -> str:
    if any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in state):
        return "eagle3"  # SafeAILab's midlayer.*, or layers.0.* as vLLM / speculators name it
    if "fc.weight" in state and any(k.startswith("layers.0.") for k in state):
        return "eagle"
    if any(re.fullmatch(rf"{re.escape(p)}\d+\.0\.linear\.weight", k) for k in state for p in _MEDUSA_PREFIXES):
        return "medusa"
    shown = ", ".join(sorted(state)[:8])
    raise IncompatibleHeadError(f"unrecognised head checkpoint (keys: {shown}, ...): expected our own format, "
                                "SafeAILab EAGLE (fc.*, layers.0.*), EAGLE-3 (midlayer.*, d2t) or Medusa "
                                "(medusa_lm_head.{i}.0.linear.*)")


# ---- the modules ---------------------------------------------------------------------------------------------


class _OwnEmbedding:
    """A checkpoint that carries its own token embeddings uses them (EAGLE loads them over the target's)."""

    own_embed: nn.Embedding | None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.own_embed is None:
            return DraftHead.embed(self, tokens)  # type: ignore[arg-type]
        with torch.no_grad():
            return self.own_embed(tokens)


class Eagle1Head(_OwnEmbedding, EagleHead):
    """SafeAILab EAGLE-1/2: our EagleHead with the first layer's input norm and the final norm removed."""

    def __init__(self, cfg: HeadConfig, own_embed: bool = False) -> None:
        super().__init__(cfg)
        self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.norm = nn.Identity()  # type: ignore[assignment]
        self.own_embed = nn.Embedding(cfg.draft_vocab_size, cfg.hidden_size) if own_embed else None


class Eagle3Head(_OwnEmbedding, EagleHead):
    """SafeAILab EAGLE-3: fused low/middle/high features, attention over [norm(embedding), norm(h)], its own
    output matrix over a draft vocabulary. forward returns h' (the next feature); draft_logits applies norm."""

    def __init__(self, cfg: HeadConfig, target_vocab: int, own_embed: bool = False) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        del self.fc
        attn = self.layer.self_attn
        attn.q_proj = nn.Linear(2 * d, cfg.num_heads * cfg.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.own_embed = nn.Embedding(target_vocab, d) if own_embed else None

    def attach(self, target: Transformer) -> Eagle3Head:
        own = self.lm_head.weight.detach().clone()
        super().attach(target)
        self.lm_head.weight = nn.Parameter(own, requires_grad=False)  # its own rows, not the target's
        return self

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = features
        x = torch.cat([self.layer.input_layernorm(self.embed(tokens).to(h.dtype)), self.hidden_norm(h)], dim=-1)
        if cache is None:
            t = tokens.shape[1]
            local = positions - positions[:, :1]
            cos, sin, kv_len, mask, write = attention_inputs(
                self._rope_for(int(positions.max()) + 1), h.dtype, positions, t, local, None)
        else:
            cos, sin, kv_len, mask, write = attention_inputs(
                self._rope_for(cache.max_len), h.dtype, positions, cache.max_len, slots, attn_mask)
        h = h + self.layer.self_attn(x, cos, sin, cache, write, kv_len, mask)
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()


class PublicMedusaHeads(MedusaHeads):
    """Medusa as published: each head its own stack of ResBlocks and its own output matrix [V, D]."""

    def __init__(self, cfg: HeadConfig, num_layers: int) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(d) for _ in range(num_layers)))
                                    for _ in range(cfg.num_medusa_heads))
        self.outputs = nn.ModuleList(nn.Linear(d, cfg.draft_vocab_size, bias=False)
                                     for _ in range(cfg.num_medusa_heads))

    def attach(self, target: Transformer) -> PublicMedusaHeads:
        super().attach(target)
        self.lm_head = nn.Identity()  # type: ignore[assignment]  # unused: each head has its own rows
        return self

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [k, ..., D], row i from head i (what forward returns, cut to k) -> [k, ..., V]."""
        return torch.stack([self.outputs[i](hidden[i]) for i in range(hidden.shape[0])]).float()


# ---- conversion -----------------------------------------------------------------------------------------------


def _check(what: str, theirs: object, ours: object, path: Path, kind: str) -> None:
    if theirs != ours:
        raise IncompatibleHeadError(f"{path}: this {kind} head has {what} {theirs} but the target has {ours}")


def _eagle_config(hf: dict[str, Any], target: Transformer, path: Path, kind: str, vocab: int,
                  feature_layers: list[int]) -> HeadConfig:
    from specdecode.heads.fingerprint import target_fingerprint

    tc = target.config
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in hf:
            raise IncompatibleHeadError(f"{path}/config.json lacks {key!r} (a {kind} head's config has the "
                                        "target's LlamaConfig fields)")
    if hf.get("rope_scaling"):
        raise IncompatibleHeadError(f"{path}: rope_scaling {hf['rope_scaling']} in a {kind} head is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise IncompatibleHeadError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if "target_hidden_size" in hf and hf["target_hidden_size"] != hf["hidden_size"]:
        raise IncompatibleHeadError(f"{path}: a draft width ({hf['hidden_size']}) other than the target's "
                                    f"({hf['target_hidden_size']}) is not supported")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    _check("hidden size", d, tc.hidden_size, path, kind)
    _check("vocabulary size", int(hf.get("vocab_size", tc.vocab_size)), tc.vocab_size, path, kind)
    return HeadConfig(
        kind="eagle", target=target_fingerprint(target), hidden_size=d, draft_vocab_size=vocab,
        intermediate_size=int(hf["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=d // heads,
        rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("qkv_bias", False)), feature_layers=feature_layers,
        training={"source": f"public {kind} checkpoint", "path": str(path)},
    )


def _load_strict(head: nn.Module, state: dict[str, torch.Tensor], path: Path, kind: str) -> None:
    ours = head.state_dict()
    missing = sorted(k for k in ours if k not in state and k not in ("lm_head.weight", "d2t"))
    unexpected = sorted(k for k in state if k not in ours)
    wrong = sorted(f"{k} {list(state[k].shape)} vs {list(ours[k].shape)}" for k in state
                   if k in ours and state[k].shape != ours[k].shape)
    if missing or unexpected or wrong:
        raise IncompatibleHeadError(f"{path}: the {kind} checkpoint does not match its config and the target "
                                    f"(missing {missing}, unexpected {unexpected}, shape mismatches {wrong})")
    head.load_state_dict(state, strict=False)


def _eagle1(state: dict[str, torch.Tensor], hf: dict[str, Any], target: Transformer, path: Path) -> Eagle1Head:
    layers = int(hf.get("num_hidden_layers", 1))
    if layers != 1:
        raise IncompatibleHeadError(f"{path}: an EAGLE head with {layers} decoder layers is not supported (1 only)")
    cfg = _eagle_config(hf, target, path, "EAGLE", target.config.vocab_size, [])
    own = "embed_tokens.weight" in state
    head = Eagle1Head(cfg, own_embed=own)
    mapped: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.startswith("layers.0."):
            mapped["layer." + k.removeprefix("layers.0.")] = v
        elif k == "embed_tokens.weight":
            mapped["own_embed.weight"] = v
        else:
            mapped[k] = v
    if "fc.bias" not in mapped and not hf.get("bias", True):
        mapped["fc.bias"] = torch.zeros(cfg.hidden_size)
    _load_strict(head, mapped, path, "EAGLE")
    head.d2t = torch.arange(target.config.vocab_size)
    return head


def eagle3_feature_layers(hf: dict[str, Any], num_layers: int) -> list[int]:
    """The target layers whose input EAGLE-3 fuses: the checkpoint's own list, else EAGLE-3's 2, L//2, L-3."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [i for i in range(num_layers) if i in (2, num_layers // 2, num_layers - 3)]
    return [int(i) for i in ids]


def _eagle3(state: dict[str, torch.Tensor], hf: dict[str, Any], target: Transformer, path: Path) -> Eagle3Head:
    tc = target.config
    layers = eagle3_feature_layers(hf, tc.num_layers)
    fused = state["fc.weight"].shape[1] if "fc.weight" in state else 0
    if fused != len(layers) * tc.hidden_size:
        raise IncompatibleHeadError(
            f"{path}: the EAGLE-3 fc takes {fused} features but the target's layers {layers} (of {tc.num_layers}) "
            f"give {len(layers)} x {tc.hidden_size}")
    try:
        check_feature_layers(layers, tc.num_layers)
    except ValueError as e:
        raise IncompatibleHeadError(f"{path}: EAGLE-3 {e}") from None
    vd = int(hf.get("draft_vocab_size") or tc.vocab_size)
    cfg = _eagle_config(hf, target, path, "EAGLE-3", vd, layers)
    if cfg.attention_bias:
        raise IncompatibleHeadError(f"{path}: qkv_bias in an EAGLE-3 head is not supported")
    head = Eagle3Head(cfg, tc.vocab_size, own_embed="embed_tokens.weight" in state)
    mapped: dict[str, torch.Tensor] = {}
    state = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
             for k, v in state.items()}
    for k, v in state.items():
        if k == "fc.weight":
            mapped["fuse.weight"] = v
        elif k.startswith("midlayer.hidden_norm."):
            mapped["hidden_norm." + k.removeprefix("midlayer.hidden_norm.")] = v
        elif k.startswith("midlayer."):
            mapped["layer." + k.removeprefix("midlayer.")] = v
        elif k == "embed_tokens.weight":
            mapped["own_embed.weight"] = v
        elif k not in ("d2t", "t2d"):
            mapped[k] = v
    if "lm_head.weight" not in mapped:
        raise IncompatibleHeadError(f"{path}: the EAGLE-3 checkpoint has no lm_head.weight")
    _check("draft vocabulary rows", mapped["lm_head.weight"].shape[0], vd, path, "EAGLE-3 (config draft_vocab_size)")
    _load_strict(head, mapped, path, "EAGLE-3")
    head.lm_head.weight.data.copy_(mapped["lm_head.weight"])
    offsets = state.get("d2t")
    if offsets is None:
        if vd != tc.vocab_size:
            raise IncompatibleHeadError(f"{path}: an EAGLE-3 draft vocabulary of {vd} needs its d2t buffer")
        offsets = torch.zeros(vd, dtype=torch.long)
    _check("d2t entries", offsets.numel(), vd, path, "EAGLE-3 (draft_vocab_size)")
    d2t = torch.arange(vd) + offsets.long()  # EAGLE-3 stores target id - draft row
    if d2t.min() < 0 or d2t.max() >= tc.vocab_size or d2t.unique().numel() != vd:
        raise IncompatibleHeadError(f"{path}: d2t maps draft rows outside the target's {tc.vocab_size} ids (or "
                                    "twice onto one id)")
    head.d2t = d2t
    return head


def _medusa(state: dict[str, torch.Tensor], hf: dict[str, Any], target: Transformer,
            path: Path) -> PublicMedusaHeads:
    from specdecode.heads.config import medusa_config
    from specdecode.heads.fingerprint import target_fingerprint

    tc = target.config
    prefix = next(p for p in _MEDUSA_PREFIXES if any(re.fullmatch(rf"{re.escape(p)}\d+\.0\.linear\.weight", k)
                                                     for k in state))
    state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    found = sorted({int(m[1]) for k in state if (m := re.fullmatch(r"(\d+)\.0\.linear\.weight", k))})
    # Medusa's own loader takes the heads the weights hold (its uploaded configs under-count them).
    heads = len(found)
    n_layers = int(hf.get("medusa_num_layers", 1))
    if found != list(range(heads)) or heads < int(hf.get("medusa_num_heads", heads)):
        raise IncompatibleHeadError(f"{path}: config says {hf.get('medusa_num_heads')} Medusa heads but the weights "
                                    f"hold heads {found}")
    w = state["0.0.linear.weight"]
    _check("hidden size", w.shape[1], tc.hidden_size, path, "Medusa")
    out = state.get(f"0.{n_layers}.weight")
    if out is None:
        raise IncompatibleHeadError(f"{path}: no output matrix {prefix}0.{n_layers}.weight (medusa_num_layers "
                                    f"{n_layers})")
    _check("vocabulary size", out.shape[0], tc.vocab_size, path, "Medusa")
    cfg = medusa_config(tc, target_fingerprint(target), tc.vocab_size, heads)
    cfg.training = {"source": "public Medusa checkpoint", "path": str(path)}
    head = PublicMedusaHeads(cfg, n_layers)
    names = {f"blocks.{i}.{j}.linear.{p}": f"{i}.{j}.linear.{p}"
             for i in range(heads) for j in range(n_layers) for p in ("weight", "bias")}
    names.update({f"outputs.{i}.weight": f"{i}.{n_layers}.weight" for i in range(heads)})
    absent = sorted(prefix + theirs for theirs in names.values() if theirs not in state)
    if absent:
        raise IncompatibleHeadError(f"{path}: the Medusa checkpoint lacks {absent} (medusa_num_layers {n_layers})")
    _load_strict(head, {ours: state[theirs] for ours, theirs in names.items()}, path, "Medusa")
    return head


def load_public_head(path: Path, target: Transformer, kind: str | None = None,
                     dtype: torch.dtype | None = None) -> DraftHead:
    """A public EAGLE / EAGLE-3 / Medusa checkpoint directory as one of our heads, bound to `target`."""
    state = _read_weights(path)
    layout = detect_layout(state)
    want = "medusa" if layout == "medusa" else "eagle"
    if kind is not None and kind != want:
        raise IncompatibleHeadError(f"{path} holds a public {layout} head, not a {kind} head")
    hf = _read_config(path)
    if layout == "eagle":
        head: DraftHead = _eagle1(state, hf, target, path)
    elif layout == "eagle3":
        head = _eagle3(state, hf, target, path)
    else:
        head = _medusa(state, hf, target, path)
    head.to(device=target.device, dtype=dtype or target.dtype)
    head.d2t = head.d2t.long()
    head.attach(target)
    return head.eval().requires_grad_(False)

