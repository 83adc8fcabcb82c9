"""What identifies the target a head was trained for: a head only makes sense on the hidden states,
embeddings and output matrix of that exact model."""

from __future__ import annotations

import hashlib

import torch

from specdecode.model.transformer import Transformer


def target_fingerprint(target: Transformer) -> dict[str, object]:
    """Architecture plus a hash of a slice of the input embeddings (cheap; differs between checkpoints;
    the embeddings stay a plain tensor whatever format the linears are converted to)."""
    cfg = target.config
    w = target.model.embed_tokens.weight
    sample = w[:: max(1, w.shape[0] // 64), :64].float().contiguous()  # 64 rows x 64 columns
    digest = hashlib.sha256(sample.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    return {"arch": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers, "embedding_sha": digest}
