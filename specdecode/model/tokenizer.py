"""Tokenizer facade over Hugging Face tokenizers: encode, decode, chat template, vocab."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_id: int | None = None) -> None:
        self.hf = hf
        eos = eos_token_id if eos_token_id is not None else hf.eos_token_id
        self.eos_token_id: int | None = int(eos) if eos is not None else None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(str(path)))

    @classmethod
    def from_gguf(cls, gguf_path: Path) -> Tokenizer:
        """Build a fast tokenizer from the GGUF's metadata (transformers' converter)."""
        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        return cls(hf)

    def save(self, path: Path) -> None:
        self.hf.save_pretrained(str(path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.convert_ids_to_tokens(int(token_id))

    def vocab(self) -> dict[int, str]:
        """id -> token string, special tokens included (for draft/target validation)."""
        return {i: t for t, i in self.hf.get_vocab().items()}

    def special_tokens(self) -> dict[str, int | None]:
        return {"eos": self.eos_token_id, "bos": self.hf.bos_token_id, "pad": self.hf.pad_token_id}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                            ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use plain completion instead")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        # The template already holds any BOS it wants.
        return list(self.hf.encode(text, add_special_tokens=False))
