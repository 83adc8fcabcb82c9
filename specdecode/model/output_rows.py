"""A draft model's output matrix cut to a draft vocabulary: the rows of the ids it may propose.

A small draft's output matrix is a large share of its forward (Qwen2.5's 0.5B: 151,936 rows of 896, about
as many weight bytes as a third of its layers), and most of its rows are ids a draft hardly ever gets right.
Byte-level BPE numbers its tokens in merge order, the most frequent pieces of the tokenizer's broad training
corpus first, so the lowest ids (plus the added tokens: end of turn, tool markers) hold nearly every token an
answer uses. A draft scoring only those proposes the same tokens almost everywhere at a fraction of the
output cost; verification is unchanged and exact for any draft distribution, the restricted one included
(an id outside has draft probability 0, and sampling's residual max(0, p - q) keeps the target's mass there).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdecode.model.gguf_linear import TILE, GGUFLinear
from specdecode.model.transformer import Transformer


def lowest_ids(vocab_size: int, size: int, added: list[int]) -> torch.Tensor:
    """Ids [0, size) and the tokenizer's added ids below vocab_size, sorted, padded with the next ids to a
    multiple of the GGUF kernels' 16-channel tile: [Vd]."""
    keep = set(range(min(size, vocab_size))) | {i for i in added if 0 <= i < vocab_size}
    nxt = min(size, vocab_size)
    while len(keep) % TILE and nxt < vocab_size:
        if nxt not in keep:
            keep.add(nxt)
        nxt += 1
    return torch.tensor(sorted(keep), dtype=torch.long)


def restrict_output(model: Transformer, ids: torch.Tensor) -> None:
    """Replace the model's output matrix by its rows `ids` [Vd] (sorted, unique); `compute_logits` still returns
    logits over every id, -inf outside. Before `convert_linears`: a dense matrix becomes an nn.Linear of the
    rows, converted with the rest; a GGUF one keeps its blocks (the file's rows of them, re-tiled)."""
    head = model.lm_head
    if getattr(head, "bias", None) is not None:
        raise ValueError("a draft vocabulary needs an output matrix without bias")
    d = model.config.hidden_size
    index = ids.long()
    if isinstance(head, GGUFLinear) and hasattr(head, "source"):
        if len(index) % TILE:
            raise ValueError(f"a GGUF output matrix keeps rows in tiles of {TILE}, not {len(index)}")
        qtype, raw = head.source
        # The kept rows' blocks are re-tiled and then dropped: only the tiles stay (a cut matrix is cut once).
        small: nn.Module = GGUFLinear([(qtype, np.ascontiguousarray(np.asarray(raw)[index.numpy()]))], d,
                                      kernel=head.kernel)
    else:
        weight = head.weight.detach()[index]  # [Vd, D]; a copy, so a tied embedding table stays whole
        small = nn.Linear(d, len(index), bias=False, dtype=weight.dtype, device=weight.device)
        small.weight = nn.Parameter(weight.clone(), requires_grad=False)
    model.lm_head = small
    model.output_ids = index.to(model.device)
