"""Tiny models whose tokenizers differ from the tiny target's byte-level BPE, for drafting across vocabularies.

- `save_sentencepiece_tokenizer`: a SentencePiece-style BPE ("▁" for spaces, bytes outside its alphabet as
  "<0xNN>" tokens, a space prepended to a text), with Gemma-like turn markers as added special tokens and a chat
  template of its own.
- `permuted_copy`: the target itself behind another vocabulary: its BPE with every id moved and one special token
  more, the embedding and output rows moved with them, so it computes what the target computes on the same text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from conftest import TINY_VOCAB_CORPUS, make_tiny_hf_dir
from safetensors.torch import load_file, save_file

TURN_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_sentencepiece_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<bos>", "<eos>"], show_progress=False)
    tok.train_from_iterator(TINY_VOCAB_CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = len(vocab)
    vocab.update({f"<0x{b:02X}>": first + b for b in range(256)})  # byte fallback
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_turn>", bos_token="<bos>",
                                   unk_token="<unk>")
    fast.chat_template = TURN_TEMPLATE
    fast.save_pretrained(str(path))
    return len(fast)


def save_ascii_tokenizer(path: Path) -> int:
    """Byte-level, one id per ASCII character and no merges: every text has one tokenization, so whatever a
    random model emits is what re-tokenizing its text gives."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdecode.model.token_bytes import byte_level_alphabet

    spelling = {b: c for c, b in byte_level_alphabet().items()}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{spelling[b]: 3 + b for b in range(128)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    return len(fast)


def sentencepiece_tiny_dir(path: Path, seed: int = 3) -> Path:
    """A random tiny Llama over the SentencePiece-style vocabulary."""
    return make_tiny_hf_dir(path, "llama", seed=seed, save_tokenizer=save_sentencepiece_tokenizer)


def permuted_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """`src` behind a permuted vocabulary with one more special token (see the module doc)."""
    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = {t["id"] for t in spec["added_tokens"]}
    movable = sorted(i for i in vocab.values() if i not in added)
    order = torch.randperm(len(movable), generator=torch.Generator().manual_seed(seed)).tolist()
    new_id = {old: movable[j] for old, j in zip(movable, order, strict=True)} | {i: i for i in added}
    spec["model"]["vocab"] = {piece: new_id[i] for piece, i in vocab.items()}
    size = max(new_id.values()) + 1
    spec["added_tokens"].append({"id": size, "content": "<|tool|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vocab_size"] = size + 1
    (dst / "config.json").write_text(json.dumps(cfg))
    moved = torch.tensor([new_id[i] for i in range(size)])
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:  # the new token's rows are zeros: its logit 0 loses to the peaked real ones
                w = tensors[name]
                out = torch.zeros((size + 1, w.shape[1]), dtype=w.dtype)
                out[moved] = w[:size]
                tensors[name] = out
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst
