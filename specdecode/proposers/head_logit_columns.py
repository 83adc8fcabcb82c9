"""The logit columns a head drafts from for one request: its draft vocabulary, plus the prompt's tokens
outside it (see `DraftHead.prompt_columns`)."""

from __future__ import annotations

import torch

from specdecode.heads.modules import DraftHead


class HeadColumns:
    def __init__(self, head: DraftHead, from_prompt: bool = True) -> None:
        self.head = head
        self.from_prompt = from_prompt
        self.token_map = head.d2t  # [Vd + m] logit column -> target id
        self.rows: torch.Tensor | None = None  # [m, D] output rows of the prompt's extra tokens

    def begin(self, prompt_ids: list[int]) -> None:
        """Set the columns for a new request."""
        self.token_map, self.rows = self.head.d2t, None
        if self.from_prompt:
            ids, rows = self.head.prompt_columns(prompt_ids)
            if ids.numel():
                self.token_map, self.rows = torch.cat([self.head.d2t, ids]), rows

    def logits(self, hidden: torch.Tensor, small: torch.Tensor | None = None) -> torch.Tensor:
        """[..., D] -> fp32 logits over the columns [..., Vd + m]. `small`: the draft vocabulary's logits of
        `hidden`, when a batch proposer computed every row's in one product."""
        if small is None:
            small = self.head.draft_logits(hidden)
        if self.rows is None:
            return small
        extra = (hidden.to(self.rows.dtype) @ self.rows.T).float()
        return torch.cat([small, extra], dim=-1)
