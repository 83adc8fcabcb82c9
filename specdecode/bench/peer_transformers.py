"""The Hugging Face transformers peer: ``model.generate`` greedy on the target's weights, alone and with
transformers' own assisted generation and prompt lookup.

- ``hf-plain``: ``model.generate`` greedy on the target's weights (a GGUF is dequantized first, as ours is).
- ``hf-assisted``: ``assistant_model=`` the draft loaded the same way, with transformers' own
  default schedule (whatever the draft's ``generation_config`` holds; unset means the library
  default, in transformers 5: 20 tokens, "constant", confidence threshold 0.4, which HF adapts
  across calls and keeps).
- ``hf-assisted-k4``: the same with ``num_assistant_tokens=4``, schedule ``"constant"``.
- ``hf-prompt-lookup``: ``prompt_lookup_num_tokens=10`` (the value transformers' docs use;
  the library has no default: ``None`` disables it), ``max_matching_ngram_size`` at its default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.peer_base import GenerateFn, Peer, PeerContext, PeerMethod


def _hf_load(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from specdecode.model.load import hf_checkpoint_dir

    # Not from_pretrained(gguf_file=...): transformers 5 keeps GGUF weights packed and computes in its
    # own kernels. Our dequantized copy makes the peer run on exactly the weights we run on.
    model = AutoModelForCausalLM.from_pretrained(str(hf_checkpoint_dir(path, dtype)), dtype=dtype)
    return model.eval()


class TransformersPeer(Peer):
    name = "transformers"
    package = "transformers"

    def __init__(self, ctx: PeerContext) -> None:
        super().__init__(ctx)
        self.model: Any = None
        self.assistant: Any = None

    def method_names(self) -> list[str]:
        names = ["hf-plain"]
        if self.ctx.draft_path is not None:
            names += ["hf-assisted", "hf-assisted-k4"]
        names.append("hf-prompt-lookup")
        return names

    def _kwargs(self) -> dict[str, Any]:
        ctx = self.ctx
        kw: dict[str, Any] = {"max_new_tokens": ctx.max_tokens, "eos_token_id": ctx.eos_token_id,
                              "pad_token_id": ctx.eos_token_id, "repetition_penalty": 1.0}
        if ctx.temperature > 0:
            kw.update(do_sample=True, temperature=ctx.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        return kw

    def _make(self, extra: Callable[[], dict[str, Any]]) -> GenerateFn:
        def generate(ids: list[int]) -> list[int]:
            input_ids = torch.tensor([ids], dtype=torch.long)
            if self.ctx.temperature > 0:
                torch.manual_seed(self.ctx.seed)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), **self._kwargs(), **extra()
                )
            return out[0, len(ids):].tolist()

        return generate

    def open(self) -> list[PeerMethod]:
        ctx = self.ctx
        self.model = _hf_load(ctx.target_path, ctx.dtype)
        methods = [PeerMethod("hf-plain", self._make(dict))]
        if ctx.draft_path is not None:
            self.assistant = _hf_load(ctx.draft_path, ctx.dtype)
            gen_cfg = self.assistant.generation_config
            keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            default = {k: getattr(gen_cfg, k, None) for k in keys}
            assisted = lambda: {"assistant_model": self.assistant}

            def restore_default() -> None:  # once per method: what HF adapts across calls stays adapted
                for k, v in default.items():
                    setattr(self.assistant.generation_config, k, v)

            def set_k4() -> None:
                restore_default()
                self.assistant.generation_config.num_assistant_tokens = 4
                self.assistant.generation_config.num_assistant_tokens_schedule = "constant"

            shown = {k: ("library default" if v is None else v) for k, v in default.items()}
            methods.append(PeerMethod("hf-assisted", self._make(assisted), shown, restore_default))
            methods.append(PeerMethod("hf-assisted-k4", self._make(assisted), {
                **shown, "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"}, set_k4))
        methods.append(PeerMethod("hf-prompt-lookup", self._make(lambda: {"prompt_lookup_num_tokens": 10}),
                                  {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": "library default"}))
        return methods

    def close(self) -> None:
        self.model = self.assistant = None
        super().close()
